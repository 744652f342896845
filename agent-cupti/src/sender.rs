//! The sender thread: owns the unix socket to the agent.
//!
//! Host threads never wait for it: buffer callbacks `try_send` batches into a
//! bounded queue and count what does not fit. This thread connects (and
//! reconnects every `reconnect_ms`), sends the hello, device info, the clock
//! calibration, names before their first use on each connection, the
//! batches, and cumulative counters every `report_ms` and at exit. A stopped
//! agent only stalls this thread (the queue then fills and drops are
//! counted); a gone agent is noticed on write and its batch is counted as
//! lost. Writes use MSG_NOSIGNAL: a closed socket must never SIGPIPE the host.

use crate::inject::Injection;
use hopscope_gpu_wire::{self as wire, Counter, Message};
use std::io;
use std::os::unix::io::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender};
use std::time::{Duration, Instant};

pub enum Item {
    Batch(crate::convert::Batch),
    /// Exit: everything queued before it is written; then the final counters
    /// and goodbye; then the ack.
    Drain(SyncSender<()>),
}

struct Conn {
    stream: UnixStream,
    announced: u32,
    devices_sent: usize,
    calibration_gen: u64,
    last_counters: Vec<(u16, u64)>,
}

/// Writes all of `buf`, retrying on timeouts (a stalled reader stalls us,
/// never the host) and failing on a broken connection.
fn send_all(stream: &UnixStream, mut buf: &[u8]) -> io::Result<()> {
    while !buf.is_empty() {
        // SAFETY: the fd is owned by `stream`, alive for this call; `buf` is
        // valid for `buf.len()` bytes. MSG_NOSIGNAL: EPIPE instead of SIGPIPE.
        let n = unsafe { libc::send(stream.as_raw_fd(), buf.as_ptr().cast(), buf.len(), libc::MSG_NOSIGNAL) };
        if n > 0 {
            buf = &buf[n as usize..];
            continue;
        }
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "agent socket accepted no bytes"));
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => continue,
            _ => return Err(e),
        }
    }
    Ok(())
}

impl Conn {
    fn open(st: &Injection) -> io::Result<Conn> {
        let path = st.cfg.socket.as_deref().ok_or_else(|| io::Error::other("no socket configured"))?;
        let stream = UnixStream::connect(path)?;
        stream.set_write_timeout(Some(Duration::from_millis(100)))?;
        st.counters.add(Counter::Connects, 1);
        let mut c = Conn { stream, announced: 0, devices_sent: 0, calibration_gen: 0, last_counters: Vec::new() };
        let mut out = Vec::with_capacity(512);
        Message::Hello(st.hello()).encode(&mut out);
        send_all(&c.stream, &out)?;
        c.updates(st, true)?;
        Ok(c)
    }

    /// Devices and calibration not yet sent on this connection; counters when
    /// changed (or `force`).
    fn updates(&mut self, st: &Injection, force: bool) -> io::Result<()> {
        let mut out = Vec::new();
        {
            let devs = st.devices.lock().unwrap_or_else(|e| e.into_inner());
            for d in &devs[self.devices_sent.min(devs.len())..] {
                Message::Device(d.clone()).encode(&mut out);
            }
            self.devices_sent = devs.len();
        }
        if let Some((cal, generation)) = st.clock.calibration() {
            if generation != self.calibration_gen {
                Message::Calibration(cal).encode(&mut out);
                self.calibration_gen = generation;
            }
        }
        let snap = st.counters.snapshot();
        if force || snap != self.last_counters {
            Message::Counters(wire::Counters { values: snap.clone() }).encode(&mut out);
            self.last_counters = snap;
        }
        send_all(&self.stream, &out)
    }

    fn batch(&mut self, st: &Injection, b: &crate::convert::Batch) -> io::Result<()> {
        if b.max_name_id > self.announced {
            let mut out = Vec::new();
            {
                let names = st.names.lock().unwrap_or_else(|e| e.into_inner());
                for id in self.announced + 1..=b.max_name_id {
                    let name = names.get(id).map(|n| n.to_string()).unwrap_or_default();
                    Message::Name(wire::Name { id, name }).encode(&mut out);
                }
            }
            send_all(&self.stream, &out)?;
            self.announced = b.max_name_id;
        }
        send_all(&self.stream, &b.bytes)
    }
}

pub fn run(st: &'static Injection, rx: Receiver<Item>) {
    let reconnect = Duration::from_millis(st.cfg.reconnect_ms);
    let report = Duration::from_millis(st.cfg.report_ms);
    let tick = reconnect.min(report).min(Duration::from_millis(100));
    let mut conn: Option<Conn> = None;
    let mut next_attempt = Instant::now();
    let mut next_report = Instant::now() + report;
    let drop_conn = |conn: &mut Option<Conn>, next_attempt: &mut Instant| {
        *conn = None;
        st.connected.store(false, Ordering::Release);
        *next_attempt = Instant::now() + reconnect;
    };
    loop {
        // Connect first thing, then whenever the pause has passed.
        let now = Instant::now();
        if conn.is_none() && now >= next_attempt {
            match Conn::open(st) {
                Ok(c) => {
                    conn = Some(c);
                    st.connected.store(true, Ordering::Release);
                    next_report = now + report;
                }
                Err(_) => next_attempt = now + reconnect,
            }
        }
        match rx.recv_timeout(tick) {
            Ok(Item::Batch(b)) => {
                st.queued.fetch_sub(b.bytes.len(), Ordering::AcqRel);
                match conn.as_mut() {
                    None => st.counters.add(Counter::DroppedNoAgent, b.records),
                    Some(c) => match c.batch(st, &b) {
                        Ok(()) => st.counters.add(Counter::RecordsSent, b.records),
                        Err(_) => {
                            st.counters.add(Counter::DroppedSendError, b.records);
                            drop_conn(&mut conn, &mut next_attempt);
                        }
                    },
                }
            }
            Ok(Item::Drain(ack)) => {
                if let Some(c) = conn.as_mut() {
                    let ok = c.updates(st, true).and_then(|_| send_all(&c.stream, &Message::Goodbye.to_frame()));
                    if ok.is_err() {
                        drop_conn(&mut conn, &mut next_attempt);
                    }
                }
                let _ = ack.send(());
                continue;
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
        let now = Instant::now();
        if now >= next_report {
            next_report = now + report;
            if let Some(c) = conn.as_mut() {
                if c.updates(st, false).is_err() {
                    drop_conn(&mut conn, &mut next_attempt);
                }
            }
        }
    }
}
