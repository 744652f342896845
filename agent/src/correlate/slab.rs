//! Values under keys the store hands out: a slot index and the slot's
//! generation. A look-up is an index and a compare where a hash map hashes
//! and probes; the engine-side attribution looks its requests up several
//! times per engine output step and member. A removed value's key never
//! finds the slot's next value (the generation moved on), as a map whose
//! keys are never reused behaves. Memory follows the most values held at
//! once (freed slots are reused), not how many were ever inserted.

/// A [`Slab`]'s key: generation in the high 32 bits, slot in the low 32.
pub type SlabKey = u64;

/// A key no slab hands out (slot 2^32 - 1 is never reached).
pub const NO_KEY: SlabKey = u64::MAX;

#[derive(Debug)]
struct Slot<T> {
    gen: u32,
    val: Option<T>,
}

#[derive(Debug)]
pub struct Slab<T> {
    slots: Vec<Slot<T>>,
    /// Empty slots, reused last freed first.
    free: Vec<u32>,
    len: usize,
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Slab { slots: Vec::new(), free: Vec::new(), len: 0 }
    }
}

fn key(slot: u32, gen: u32) -> SlabKey {
    u64::from(gen) << 32 | u64::from(slot)
}

impl<T> Slab<T> {
    #[inline]
    pub fn insert(&mut self, v: T) -> SlabKey {
        self.len += 1;
        match self.free.pop() {
            Some(i) => {
                let s = &mut self.slots[i as usize];
                s.val = Some(v);
                key(i, s.gen)
            }
            None => {
                let i = u32::try_from(self.slots.len()).expect("fewer than 2^32 values held at once");
                self.slots.push(Slot { gen: 0, val: Some(v) });
                key(i, 0)
            }
        }
    }

    #[inline]
    pub fn get(&self, k: SlabKey) -> Option<&T> {
        match self.slots.get(k as u32 as usize) {
            Some(s) if s.gen == (k >> 32) as u32 => s.val.as_ref(),
            _ => None,
        }
    }

    #[inline]
    pub fn get_mut(&mut self, k: SlabKey) -> Option<&mut T> {
        match self.slots.get_mut(k as u32 as usize) {
            Some(s) if s.gen == (k >> 32) as u32 => s.val.as_mut(),
            _ => None,
        }
    }

    #[inline]
    pub fn contains_key(&self, k: SlabKey) -> bool {
        self.get(k).is_some()
    }

    #[inline]
    pub fn remove(&mut self, k: SlabKey) -> Option<T> {
        let i = k as u32;
        let s = self.slots.get_mut(i as usize)?;
        if s.gen != (k >> 32) as u32 {
            return None;
        }
        let v = s.val.take()?;
        self.free_slot(i);
        Some(v)
    }

    fn free_slot(&mut self, i: u32) {
        let s = &mut self.slots[i as usize];
        // Wrapping: a key 2^32 removals old could find the slot again; none
        // lives that long (requests are let go within minutes).
        s.gen = s.gen.wrapping_add(1);
        self.free.push(i);
        self.len -= 1;
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Every value held and its key, in slot order.
    pub fn iter(&self) -> impl Iterator<Item = (SlabKey, &T)> {
        self.slots.iter().enumerate().filter_map(|(i, s)| s.val.as_ref().map(|v| (key(i as u32, s.gen), v)))
    }

    /// Every value held, in slot order.
    pub fn into_values(self) -> impl Iterator<Item = T> {
        self.slots.into_iter().filter_map(|s| s.val)
    }

    /// Keeps the values `keep` says yes to.
    pub fn retain(&mut self, mut keep: impl FnMut(&mut T) -> bool) {
        for i in 0..self.slots.len() {
            let s = &mut self.slots[i];
            if s.val.as_mut().is_some_and(|v| !keep(v)) {
                s.val = None;
                self.free_slot(i as u32);
            }
        }
    }
}

impl<T> std::ops::Index<SlabKey> for Slab<T> {
    type Output = T;
    fn index(&self, k: SlabKey) -> &T {
        self.get(k).expect("a key of a value held")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn a_removed_values_key_does_not_find_the_slots_next_value() {
        let mut s = Slab::default();
        let a = s.insert("a");
        assert_eq!(s.remove(a), Some("a"));
        let b = s.insert("b");
        assert_eq!(a as u32, b as u32, "the slot is reused");
        assert_eq!(s.get(a), None);
        assert!(!s.contains_key(a));
        assert_eq!(s.remove(a), None);
        assert_eq!(s.get(b), Some(&"b"));
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn behaves_as_a_map_with_never_reused_keys_over_random_operations() {
        // A map from the slab's keys, and every key ever handed out.
        let mut s: Slab<u64> = Slab::default();
        let mut m: HashMap<SlabKey, u64> = HashMap::new();
        let mut keys: Vec<SlabKey> = Vec::new();
        let mut ever = std::collections::HashSet::new();
        let mut next = crate::testutil::xorshift(0x9e37_79b9_7f4a_7c15);
        for step in 0..20_000u64 {
            let x = next();
            match x % 5 {
                0 | 1 => {
                    let k = s.insert(step);
                    assert!(ever.insert(k), "key {k:#x} handed out twice");
                    m.insert(k, step);
                    keys.push(k);
                }
                2 if !keys.is_empty() => {
                    let k = keys[(x >> 8) as usize % keys.len()];
                    assert_eq!(s.remove(k), m.remove(&k));
                }
                3 if step % 1000 == 3 => {
                    s.retain(|v| *v % 3 != 0);
                    m.retain(|_, v| *v % 3 != 0);
                }
                _ if !keys.is_empty() => {
                    let k = keys[(x >> 8) as usize % keys.len()];
                    if let Some(v) = s.get_mut(k) {
                        *v += 1;
                    }
                    if let Some(v) = m.get_mut(&k) {
                        *v += 1;
                    }
                }
                _ => {}
            }
            assert_eq!(s.len(), m.len());
        }
        for &k in &keys {
            assert_eq!(s.get(k), m.get(&k), "key {k:#x}");
        }
        let mut held: Vec<(SlabKey, u64)> = s.iter().map(|(k, v)| (k, *v)).collect();
        let mut want: Vec<(SlabKey, u64)> = m.iter().map(|(k, v)| (*k, *v)).collect();
        held.sort_unstable();
        want.sort_unstable();
        assert_eq!(held, want, "iter gives every value held under its key");
        assert!(s.slots.len() < 20_000 / 2, "freed slots are reused: {} slots", s.slots.len());
        let mut values: Vec<u64> = s.into_values().collect();
        let mut want_values: Vec<u64> = want.iter().map(|w| w.1).collect();
        values.sort_unstable();
        want_values.sort_unstable();
        assert_eq!(values, want_values, "into_values gives every value held");
    }
}
