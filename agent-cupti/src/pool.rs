//! A bounded pool of activity buffers handed to CUPTI.
//!
//! Buffers are `size` bytes, page-aligned (CUPTI needs 8), allocated lazily up
//! to `max` and then reused for the life of the process (CUPTI may hold them
//! until exit). When every buffer is out, the request gets none and CUPTI
//! drops records and counts them (`cuptiActivityGetNumDroppedRecords`):
//! memory stays bounded and the host thread never waits.

use std::alloc::Layout;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

const ALIGN: usize = 4096;

pub struct BufferPool {
    layout: Layout,
    max: usize,
    /// Addresses of every buffer we allocated (at most `max`).
    all: Mutex<Vec<usize>>,
    free: Mutex<Vec<usize>>,
    out: AtomicUsize,
}

impl BufferPool {
    pub fn new(size: usize, max: usize) -> BufferPool {
        let layout = Layout::from_size_align(size.max(ALIGN), ALIGN).unwrap_or(Layout::new::<[u8; ALIGN]>());
        BufferPool { layout, max, all: Mutex::new(Vec::with_capacity(max)), free: Mutex::new(Vec::with_capacity(max)), out: AtomicUsize::new(0) }
    }

    pub fn size(&self) -> usize {
        self.layout.size()
    }

    /// A free buffer, or None when `max` are out.
    pub fn take(&self) -> Option<*mut u8> {
        if let Some(p) = self.free.lock().unwrap_or_else(|e| e.into_inner()).pop() {
            self.out.fetch_add(1, Ordering::Relaxed);
            return Some(p as *mut u8);
        }
        let mut all = self.all.lock().unwrap_or_else(|e| e.into_inner());
        if all.len() >= self.max {
            return None;
        }
        // SAFETY: the layout has a nonzero size; the memory is owned by the
        // pool for the life of the process (never freed: CUPTI may hold it).
        let p = unsafe { std::alloc::alloc(self.layout) };
        if p.is_null() {
            return None;
        }
        all.push(p as usize);
        self.out.fetch_add(1, Ordering::Relaxed);
        Some(p)
    }

    /// Returns a buffer; pointers the pool did not allocate are ignored.
    pub fn give_back(&self, p: *mut u8) -> bool {
        if p.is_null() || !self.all.lock().unwrap_or_else(|e| e.into_inner()).contains(&(p as usize)) {
            return false;
        }
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        if free.contains(&(p as usize)) {
            return false;
        }
        free.push(p as usize);
        self.out.fetch_sub(1, Ordering::Relaxed);
        true
    }

    /// Buffers currently handed out.
    #[cfg(test)]
    pub fn outstanding(&self) -> usize {
        self.out.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pool_is_bounded_reuses_buffers_and_ignores_foreign_pointers() {
        let pool = BufferPool::new(64 * 1024, 2);
        let a = pool.take().unwrap();
        let b = pool.take().unwrap();
        assert_eq!(a as usize % ALIGN, 0);
        assert!(pool.take().is_none(), "bounded");
        assert!(pool.give_back(a));
        assert!(!pool.give_back(a), "double return ignored");
        let mut x = 0u8;
        assert!(!pool.give_back(&mut x), "foreign pointer ignored");
        assert_eq!(pool.take(), Some(a), "reused");
        assert_eq!(pool.outstanding(), 2);
        assert!(pool.give_back(b));
        assert_eq!(pool.size(), 64 * 1024);
    }
}
