//! Real eBPF against real processes (root only): loads hopscope's programs
//! through the library API, runs small Python programs as the traced target,
//! and checks the captured events byte for byte.
//!
//! Not root / no tracefs: every test prints a loud SKIPPED line and returns.
//! Tests hold the shared serial guard (`hopscope_integration::privileged`): each
//! loads its own copy of the programs, and the
//! timing checks (off-CPU) want a quiet machine.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use hopscope_integration::privileged;
use hopscope::event::{Burst, ConnEvent, ConnOp, Dir, Family, IoEvent, KEvent, ProcOp, Syscall};
use hopscope::source::ebpf::{EbpfConfig, EbpfSource, SourceError};



/// A Python program that prints one `ready …` line, waits for `go` on stdin,
/// does its work, prints `done …` and exits. stdin/stdout are pipes, which
/// the kernel side ignores (not sockets).
struct Py {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

const PRELUDE: &str = r#"
import os, socket, sys, threading, time
def out(*a):
    print(*a, flush=True)
def wait_go():
    assert sys.stdin.readline().strip() == "go"
"#;

impl Py {
    fn spawn(body: &str) -> Py {
        let script = format!("{PRELUDE}\n{body}");
        let mut child = Command::new("python3")
            .arg("-c")
            .arg(script)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawning python3");
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Py { child, stdin, stdout }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Next stdout line that starts with `prefix`, split into words after it.
    fn line(&mut self, prefix: &str) -> Vec<String> {
        let mut l = String::new();
        loop {
            l.clear();
            let n = self.stdout.read_line(&mut l).unwrap();
            assert!(n > 0, "python exited before printing `{prefix}`");
            if let Some(rest) = l.trim_end().strip_prefix(prefix) {
                return rest.split_whitespace().map(str::to_owned).collect();
            }
        }
    }

    fn go(&mut self) {
        self.stdin.write_all(b"go\n").unwrap();
        self.stdin.flush().unwrap();
    }

    fn finish(mut self) -> i32 {
        let st = self.child.wait().unwrap();
        st.code().unwrap_or(-1)
    }
}

/// What one traced run of a [`Py`] script left: its `ready` and `done`
/// words, its pid, the source (for its counters and targets) and every event
/// the kernel delivered.
struct Traced {
    ready: Vec<String>,
    done: Vec<String>,
    pid: u32,
    src: EbpfSource,
    evs: Vec<KEvent>,
}

impl Py {
    /// The sequence every single-script capture test follows: attach once the
    /// script is ready (so its set-up is not traced), let it go, wait for its
    /// `done` line and its exit (status 0), then drain the ring.
    fn traced(mut self, tweak: impl FnOnce(&mut EbpfConfig)) -> Traced {
        let ready = self.line("ready");
        let mut src = start(vec![self.pid()], tweak);
        self.go();
        let done = self.line("done");
        let pid = self.pid();
        assert_eq!(self.finish(), 0, "the traced script failed (its stderr is above)");
        let evs = collect(&mut src);
        Traced { ready, done, pid, src, evs }
    }
}

fn start(pids: Vec<u32>, tweak: impl FnOnce(&mut EbpfConfig)) -> EbpfSource {
    let mut cfg = EbpfConfig { pids, ..EbpfConfig::default() };
    tweak(&mut cfg);
    let t = Instant::now();
    let src = match EbpfSource::start(cfg) {
        Ok(s) => s,
        Err(e) => panic!("EbpfSource::start failed: {}", chain(&e)),
    };
    eprintln!("ebpf source started in {:?} ({:?})", t.elapsed(), src.startup_times());
    src
}

fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// Drains until the ring stays empty for a few timer rounds; panics on any
/// malformed record (the decoder must accept everything the kernel sends).
fn collect(src: &mut EbpfSource) -> Vec<KEvent> {
    let mut out = Vec::new();
    let mut quiet = 0;
    let deadline = Instant::now() + Duration::from_secs(10);
    while quiet < 3 && Instant::now() < deadline {
        let n = src
            .poll(Duration::from_millis(50), |ev| match ev {
                Ok(ev) => out.push(ev),
                Err(e) => panic!("kernel sent a record the decoder rejects: {e}"),
            })
            .unwrap();
        quiet = if n == 0 { quiet + 1 } else { 0 };
    }
    out
}

fn ios(evs: &[KEvent], tgid: u32) -> Vec<&IoEvent> {
    evs.iter()
        .filter_map(|e| match e {
            KEvent::Io(io) if io.conn.tgid == tgid => Some(io),
            _ => None,
        })
        .collect()
}

fn find_io<'a>(evs: &'a [KEvent], tgid: u32, syscall: Syscall, data: &[u8]) -> &'a IoEvent {
    let all = ios(evs, tgid);
    all.iter().copied().find(|io| io.syscall == syscall && io.data == data).unwrap_or_else(|| {
        panic!(
            "no {syscall:?} event carrying {:?} from tgid {tgid}; io events seen: {:#?}",
            String::from_utf8_lossy(data),
            all.iter()
                .map(|io| (io.syscall, io.dir, io.family, io.len, String::from_utf8_lossy(&io.data).into_owned()))
                .collect::<Vec<_>>()
        )
    })
}

/// The first accept or connect (`op`) of process `tgid`.
fn conn_event(evs: &[KEvent], tgid: u32, op: ConnOp) -> Option<&ConnEvent> {
    evs.iter().find_map(|e| match e {
        KEvent::Conn(c) if c.conn.tgid == tgid && c.op == op => Some(c),
        _ => None,
    })
}

fn assert_no_self_events(evs: &[KEvent]) {
    let me = std::process::id();
    let mine: Vec<&KEvent> = evs
        .iter()
        .filter(|e| match e {
            KEvent::Io(x) => x.conn.tgid == me,
            KEvent::Conn(x) => x.conn.tgid == me,
            KEvent::Close(x) => x.conn.tgid == me,
            KEvent::Proc(x) => x.tgid == me,
            KEvent::Sched(x) => x.tgid == me,
        })
        .collect();
    assert!(mine.is_empty(), "the agent's own activity was traced: {mine:#?}");
}

#[test]
fn tcp_accept_request_response_and_close_are_captured_but_never_the_agents_own_io() {
    let Some(_serial) = privileged("tcp_accept_request_response_and_close_are_captured_but_never_the_agents_own_io") else { return };
    // The test process is the agent *and* the root of the traced tree: the
    // python server is its child, so both are in `targets`; only the kernel's
    // self_tgid check keeps the agent's own client I/O out.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let agent_port = listener.local_addr().unwrap().port();
    let mut py = Py::spawn(&format!(
        r#"
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
out("ready", srv.getsockname()[1])
wait_go()
c, _ = srv.accept()
req = c.recv(4096)
c.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello")
c.close()
up = socket.create_connection(("127.0.0.1", {agent_port}))
up.sendall(b"upstream-bytes")
up.close()
out("done", len(req))
"#
    ));
    let port: u16 = py.line("ready")[0].parse().unwrap();
    let mut src = start(vec![std::process::id()], |_| {});
    let targets = src.targets();
    assert!(targets.contains(&py.pid()) && targets.contains(&std::process::id()), "targets {targets:?}");
    py.go();

    let request = b"GET /v1/models HTTP/1.1\r\nHost: hop\r\nX-Request-Id: r-1\r\n\r\n";
    let mut client = TcpStream::connect(("127.0.0.1", port)).unwrap();
    client.write_all(request).unwrap();
    let mut response = Vec::new();
    client.read_to_end(&mut response).unwrap();
    let (mut upstream, _) = listener.accept().unwrap();
    let mut up = Vec::new();
    upstream.read_to_end(&mut up).unwrap();
    assert_eq!(up, b"upstream-bytes");
    py.line("done");
    let pid = py.pid();
    assert_eq!(py.finish(), 0);

    let evs = collect(&mut src);
    assert_no_self_events(&evs);

    let accept = conn_event(&evs, pid, ConnOp::Accept).expect("accept event");
    assert_eq!(accept.family, Family::Inet);
    assert!(accept.ret >= 0 && accept.conn.fd as i64 == accept.ret);
    assert_eq!(accept.local, Some(format!("127.0.0.1:{port}").parse().unwrap()));
    assert_eq!(accept.peer, Some(client.local_addr().unwrap()));
    assert!(accept.conn.ino != 0);

    let req = find_io(&evs, pid, Syscall::Recvfrom, request);
    assert_eq!((req.dir, req.family, req.len), (Dir::In, Family::Inet, request.len() as u64));
    assert_eq!(req.conn, accept.conn, "request read on the accepted socket");
    assert!(req.enter_ns <= req.ts_ns && accept.ts_ns <= req.ts_ns);

    let wire_in = req.wire_ns.expect("the request's wire arrival (sock:sk_data_ready)");
    assert!(wire_in <= req.ts_ns, "arrived {wire_in} before the read returned {}", req.ts_ns);

    let resp = find_io(&evs, pid, Syscall::Sendto, &response);
    assert_eq!((resp.dir, resp.conn), (Dir::Out, accept.conn));
    // On loopback the bytes leave inside the call: its wire departure
    // (net:net_dev_queue of this socket's packet) lies between entry and exit.
    let wire_out = resp.wire_ns.expect("the response's wire departure (net:net_dev_queue)");
    assert!(resp.enter_ns <= wire_out && wire_out <= resp.ts_ns, "{} <= {wire_out} <= {}", resp.enter_ns, resp.ts_ns);
    assert_eq!(&response[..], b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello");

    let close = evs
        .iter()
        .find_map(|e| match e {
            KEvent::Close(c) if c.conn == accept.conn => Some(c),
            _ => None,
        })
        .expect("close of the accepted socket");
    assert!(close.ts_ns >= resp.ts_ns);

    let connect = conn_event(&evs, pid, ConnOp::Connect).expect("connect event");
    assert_eq!(connect.ret, 0);
    assert_eq!(connect.peer, Some(format!("127.0.0.1:{agent_port}").parse().unwrap()));
    assert_eq!(connect.local, Some(upstream.peer_addr().unwrap()));
    let upw = find_io(&evs, pid, Syscall::Sendto, b"upstream-bytes");
    assert_eq!(upw.conn, connect.conn);
    assert!(upw.wire_ns.is_some_and(|w| upw.enter_ns <= w && w <= upw.ts_ns), "a client's write departs inside the call too: {upw:?}");

    let stats = src.stats();
    assert!(stats.get("kernel_events").unwrap() >= evs.len() as u64);
    assert_eq!(stats.get("kernel_ringbuf_full"), Some(0));
}

#[test]
fn unix_socketpair_bytes_are_captured_with_the_unix_family() {
    let Some(_serial) = privileged("unix_socketpair_bytes_are_captured_with_the_unix_family") else { return };
    let py = Py::spawn(
        r#"
a, b = socket.socketpair()
out("ready")
wait_go()
a.sendall(b"unix-ping-123")
got1 = b.recv(100)
os.write(a.fileno(), b"raw-write")
got2 = os.read(b.fileno(), 100)
with open("/proc/self/stat", "rb") as f:
    f.read()   # a regular file: never captured
out("done", got1.decode(), got2.decode())
"#,
    );
    let Traced { done, pid, evs, .. } = py.traced(|_| {});
    assert_eq!(done, ["unix-ping-123", "raw-write"]);

    let send = find_io(&evs, pid, Syscall::Sendto, b"unix-ping-123");
    let recv = find_io(&evs, pid, Syscall::Recvfrom, b"unix-ping-123");
    let write = find_io(&evs, pid, Syscall::Write, b"raw-write");
    let read = find_io(&evs, pid, Syscall::Read, b"raw-write");
    for io in [send, recv, write, read] {
        assert_eq!(io.family, Family::Unix, "{io:?}");
    }
    assert_eq!((send.dir, recv.dir, write.dir, read.dir), (Dir::Out, Dir::In, Dir::Out, Dir::In));
    assert_eq!(send.conn, write.conn, "same end a");
    assert_eq!(recv.conn, read.conn, "same end b");
    assert_ne!(send.conn.ino, recv.conn.ino, "two ends, two inodes");
    // Only socket I/O: the pipes (stdin/stdout) and the /proc file are absent.
    assert_eq!(ios(&evs, pid).len(), 4, "{:#?}", ios(&evs, pid));
}

/// When a thread's in-flight slot cannot be allocated at a syscall's entry
/// (the task-storage allocation that failed inside sched_switch on a real
/// vLLM can fail here under pressure too), the entry is spilled to a
/// preallocated map and its exit still makes the record: the same bytes,
/// accept and close as always, counted as spilled, none lost. Every
/// allocation fails here (injected).
#[test]
fn a_syscall_whose_inflight_slot_cannot_be_allocated_is_spilled_not_lost() {
    let Some(_serial) = privileged("a_syscall_whose_inflight_slot_cannot_be_allocated_is_spilled_not_lost") else { return };
    let py = Py::spawn(
        r#"
a, b = socket.socketpair()
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
cl = socket.socket()
out("ready")
wait_go()
a.sendall(b"spilled-unix-ping")
got1 = b.recv(100)
cl.connect(srv.getsockname())
c, _ = srv.accept()
cl.sendall(b"spilled-tcp-ping")
got2 = c.recv(100)
c.close()
out("done", got1.decode(), got2.decode())
"#,
    );
    let Traced { done, pid, evs, src, .. } = py.traced(|c| c.fail_inflight_alloc = true);
    assert_eq!(done, ["spilled-unix-ping", "spilled-tcp-ping"]);
    let send = find_io(&evs, pid, Syscall::Sendto, b"spilled-unix-ping");
    let recv = find_io(&evs, pid, Syscall::Recvfrom, b"spilled-unix-ping");
    assert_eq!((send.family, send.dir, recv.dir, send.len), (Family::Unix, Dir::Out, Dir::In, 17));
    assert!(send.enter_ns <= send.ts_ns && send.enter_ns > 0, "{send:?}");
    let accept = conn_event(&evs, pid, ConnOp::Accept).expect("the accept, through the spill");
    assert!(conn_event(&evs, pid, ConnOp::Connect).is_some(), "the connect");
    let tcp_in = find_io(&evs, pid, Syscall::Recvfrom, b"spilled-tcp-ping");
    assert_eq!((tcp_in.family, tcp_in.conn), (Family::Inet, accept.conn));
    assert!(evs.iter().any(|e| matches!(e, KEvent::Close(c) if c.conn == accept.conn)), "the close of the accepted socket");
    let st = src.stats();
    assert!(st.get("kernel_inflight_spilled").unwrap() >= 7, "{st:?}");
    assert_eq!(st.get("kernel_inflight_full"), Some(0), "{st:?}");
}

/// A netlink dump (what a vLLM, torch and gloo read as they start, listing
/// the machine's interfaces) is seen, sized and counted, but none of its
/// bytes are copied out of the kernel: no HTTP or IPC runs there. Nor is it
/// a truncation (a loss): the family is not captured by design.
#[test]
fn netlink_io_is_seen_with_its_size_but_no_bytes_are_copied() {
    let Some(_serial) = privileged("netlink_io_is_seen_with_its_size_but_no_bytes_are_copied") else { return };
    let py = Py::spawn(
        r#"
import struct
s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
s.bind((0, 0))
# RTM_GETLINK dump: nlmsghdr + ifinfomsg
req = struct.pack("=IHHII", 32, 18, 0x301, 1, 0) + struct.pack("=BxHiII", 0, 0, 0, 0, 0)
out("ready")
wait_go()
s.send(req)
got = 0
while True:
    b = s.recv(65536)
    got += len(b)
    if struct.unpack_from("=IH", b)[1] == 3:   # NLMSG_DONE
        break
a, b2 = socket.socketpair()
a.sendall(b"after-netlink")
b2.recv(100)
out("done", got)
"#,
    );
    let Traced { done, pid, src, evs, .. } = py.traced(|_| {});
    let dumped: u64 = done[0].parse().unwrap();
    let all = ios(&evs, pid);
    let netlink: Vec<&IoEvent> = all.iter().copied().filter(|io| io.family == Family::Unknown).collect();
    let sent = netlink.iter().find(|io| io.dir == Dir::Out).unwrap_or_else(|| panic!("the request's send was not seen: {netlink:#?}"));
    assert_eq!(sent.len, 32);
    let read: u64 = netlink.iter().filter(|io| io.dir == Dir::In).map(|io| io.len).sum();
    assert_eq!(read, dumped, "every byte of the dump is sized: {netlink:#?}");
    for io in &netlink {
        assert!(io.data.is_empty() && io.tail.is_empty() && !io.copy_failed, "netlink bytes were copied: {io:?}");
    }
    // The unix socket beside it is still captured whole.
    let unix = find_io(&evs, pid, Syscall::Sendto, b"after-netlink");
    assert_eq!(unix.family, Family::Unix);
    assert_eq!(src.stats().get("kernel_truncated"), Some(0), "an uncaptured family is not a truncation");
}

#[test]
fn writev_readv_sendmsg_and_recvmsg_capture_iovecs_in_order() {
    let Some(_serial) = privileged("writev_readv_sendmsg_and_recvmsg_capture_iovecs_in_order") else { return };
    let py = Py::spawn(
        r#"
a, b = socket.socketpair()
out("ready")
wait_go()
os.writev(a.fileno(), [b"v1-", b"", b"v2-", b"v3"])
b1, b2 = bytearray(3), bytearray(100)
n = os.readv(b.fileno(), [b1, b2])
a.sendmsg([b"m1-", b"m2-", b"m3"])
data, _, _, _ = b.recvmsg(100)
# As hyper writes a chunked body (vLLM 0.34.0's Rust frontend): 16 SSE events queued, three
# iovecs each (size line, event, CRLF).
ev = [b"data: {\"i\":%02d}\n\n" % i for i in range(16)]
os.writev(a.fileno(), [p for e in ev for p in (b"%x\r\n" % len(e), e, b"\r\n")])
hyper = b""
while len(hyper) < 16 * 22:
    hyper += b.recv(4096)
os.writev(a.fileno(), [bytes([48 + i % 75]) for i in range(70)])
rest = b""
while len(rest) < 70:
    rest += b.recv(100)
out("done", n, data.decode(), len(hyper), len(rest))
"#,
    );
    let Traced { done, pid, src, evs, .. } = py.traced(|_| {});
    assert_eq!(done, ["8", "m1-m2-m3", "352", "70"]);

    let wv = find_io(&evs, pid, Syscall::Writev, b"v1-v2-v3");
    assert_eq!((wv.len, wv.gap()), (8, 0));
    let rv = find_io(&evs, pid, Syscall::Readv, b"v1-v2-v3");
    assert_eq!(rv.dir, Dir::In);
    find_io(&evs, pid, Syscall::Sendmsg, b"m1-m2-m3");
    find_io(&evs, pid, Syscall::Recvmsg, b"m1-m2-m3");
    // hyper's 48 iovecs: every byte, in order.
    let chunked: Vec<u8> = (0..16).flat_map(|i| format!("10\r\ndata: {{\"i\":{i:02}}}\n\n\r\n").into_bytes()).collect();
    let sse = find_io(&evs, pid, Syscall::Writev, &chunked);
    assert_eq!((sse.len, sse.gap()), (chunked.len() as u64, 0));
    // 70 one-byte iovecs: the kernel walks 64 and says the rest is a gap.
    let walked: Vec<u8> = (0..64u8).map(|i| 48 + i % 75).collect();
    let many = find_io(&evs, pid, Syscall::Writev, &walked);
    assert_eq!((many.len, many.gap()), (70, 6));
    let stats = src.stats();
    assert!(stats.get("kernel_iov_truncated").unwrap() >= 1, "{stats:?}");
    assert!(stats.get("kernel_truncated").unwrap() >= 1, "{stats:?}");
}

#[test]
fn writes_longer_than_capture_len_are_truncated_and_counted() {
    let Some(_serial) = privileged("writes_longer_than_capture_len_are_truncated_and_counted") else { return };
    let py = Py::spawn(
        r#"
a, b = socket.socketpair()
out("ready")
wait_go()
a.sendall(b"0123456789abcdef" * 512)
got = 0
while got < 8192:
    got += len(b.recv(4096))
out("done", got)
"#,
    );
    // A socketpair is AF_UNIX: its own knob, not capture_len. Its last 4 KiB
    // come apart (`capture_tail_unix`); what lies between is the gap.
    let Traced { pid, src, evs, .. } = py.traced(|c| c.capture_len_unix = 64);
    let expect: Vec<u8> = b"0123456789abcdef".repeat(4);
    let w = find_io(&evs, pid, Syscall::Sendto, &expect);
    assert_eq!((w.len, w.data.len(), w.tail.len(), w.gap()), (8192, 64, 4096, 4032));
    assert!(!w.copy_failed);
    for io in ios(&evs, pid) {
        assert!(io.data.len() <= 64, "capture_len_unix not honoured: {io:?}");
    }
    assert!(src.stats().get("kernel_truncated").unwrap() >= 1);
}

/// A transfer longer than its capture brings its last bytes too, after the
/// prefix and apart from it (the gap between them is what was not captured),
/// on both the writer's and the reader's side: unix sockets (a long ADD's
/// fields after its prompt ids) and TCP ones (an HTTP body's members after
/// its prompt), each family with its own tail length, and 0 turns it off.
#[test]
fn a_long_transfer_carries_its_last_bytes_after_its_prefix_on_unix_and_tcp_sockets() {
    let Some(_serial) = privileged("a_long_transfer_carries_its_last_bytes_after_its_prefix_on_unix_and_tcp_sockets") else { return };
    let script = r#"
a, b = socket.socketpair()
a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
c = socket.create_connection(srv.getsockname()); s, _ = srv.accept()
c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
data = bytes((i * 7 + i // 251) % 256 for i in range(100000))
out("ready")
wait_go()
assert a.send(data) == len(data)
assert len(b.recv(len(data), socket.MSG_WAITALL)) == len(data)
assert c.send(data[:50000]) == 50000
assert len(s.recv(50000, socket.MSG_WAITALL)) == 50000
out("done")
"#;
    let data: Vec<u8> = (0..100_000u32).map(|i| ((i * 7 + i / 251) % 256) as u8).collect();
    for (tail_unix, tail_tcp) in [(4096u32, 16384u32), (0, 0)] {
        let py = Py::spawn(script);
        let Traced { pid, evs, .. } = py.traced(|c| {
            c.capture_tail_unix = tail_unix;
            c.capture_tail = tail_tcp;
        });
        let ios = ios(&evs, pid);
        for (family, len, cap, tail) in [(Family::Unix, 100_000usize, 32768usize, tail_unix as usize), (Family::Inet, 50_000, 4096, tail_tcp as usize)] {
            let sent = &data[..len];
            let found: Vec<&&IoEvent> = ios.iter().filter(|io| io.family == family && io.len == len as u64).collect();
            assert_eq!(found.len(), 2, "{family:?}: the write and the read: {ios:?}");
            for io in found {
                assert_eq!(io.data, sent[..cap], "{family:?} {:?}: the prefix", io.dir);
                assert_eq!(io.tail, sent[len - tail..], "{family:?} {:?}: the last {tail} bytes", io.dir);
                assert_eq!(io.gap(), (len - cap - tail) as u64, "{family:?} {:?}", io.dir);
            }
        }
    }
}

#[test]
fn a_forked_child_of_the_target_is_followed_and_its_exit_reported() {
    let Some(_serial) = privileged("a_forked_child_of_the_target_is_followed_and_its_exit_reported") else { return };
    let py = Py::spawn(
        r#"
a, b = socket.socketpair()
out("ready")
wait_go()
pid = os.fork()
if pid == 0:
    a.sendall(b"from-the-child")
    os._exit(3)
_, status = os.waitpid(pid, 0)
got = b.recv(100)
out("done", pid, got.decode())
"#,
    );
    let Traced { done, pid, src, evs, .. } = py.traced(|_| {});
    let child: u32 = done[0].parse().unwrap();
    assert_eq!(done[1], "from-the-child");

    let fork = evs
        .iter()
        .find_map(|e| match e {
            KEvent::Proc(p) if p.op == ProcOp::Fork && p.child_tgid == child => Some(p),
            _ => None,
        })
        .expect("fork event");
    assert_eq!(fork.tgid, pid);
    let w = find_io(&evs, child, Syscall::Sendto, b"from-the-child");
    assert_eq!(w.family, Family::Unix);
    assert!(w.ts_ns > fork.ts_ns);
    let exit = evs
        .iter()
        .find_map(|e| match e {
            KEvent::Proc(p) if p.op == ProcOp::Exit && p.tgid == child => Some(p),
            _ => None,
        })
        .expect("exit event of the child");
    assert_eq!(exit.exit_code, 3 << 8);
    assert_eq!(exit.child_tgid, child);
    find_io(&evs, pid, Syscall::Recvfrom, b"from-the-child");
    assert!(!src.targets().contains(&child), "exited child still in targets");
}

#[test]
fn a_thread_sleeping_20ms_appears_as_an_off_cpu_interval_of_about_20ms() {
    let Some(_serial) = privileged("a_thread_sleeping_20ms_appears_as_an_off_cpu_interval_of_about_20ms") else { return };
    sleeps_of_20ms(false);
}

/// When a thread's off-CPU slot cannot be allocated at its switch-out (task
/// storage allocates inside sched_switch, interrupts off: `record --pid` on
/// a real vLLM lost 3-9 intervals so), the switch-out is spilled to a
/// preallocated map and nothing is lost: the same intervals, counted as
/// spilled, none as lost. The failures are injected.
#[test]
fn a_switch_out_whose_slot_cannot_be_allocated_is_spilled_not_lost() {
    let Some(_serial) = privileged("a_switch_out_whose_slot_cannot_be_allocated_is_spilled_not_lost") else { return };
    let st = sleeps_of_20ms(true);
    assert!(st.get("kernel_sched_spilled").unwrap() >= 1, "{st:?}");
    assert_eq!(st.get("kernel_sched_map_full"), Some(0), "{st:?}");
}

/// A thread that sleeps 20 ms five times: five off-CPU intervals of ~20 ms,
/// each with its wake-up. Returns the kernel counters.
fn sleeps_of_20ms(fail_offcpu_alloc: bool) -> hopscope::source::ebpf::KernelStats {
    let py = Py::spawn(
        r#"
tids = []
def sleeper():
    tids.append(threading.get_native_id())
    wait_go()
    for _ in range(5):
        time.sleep(0.02)
t = threading.Thread(target=sleeper); t.start()
while not tids:
    time.sleep(0.001)
out("ready", tids[0])
t.join()
out("done")
"#,
    );
    let Traced { ready, pid, src, evs, .. } = py.traced(|c| {
        c.min_offcpu_ns = 5_000_000;
        c.fail_offcpu_alloc = fail_offcpu_alloc;
    });
    let tid: u32 = ready[0].parse().unwrap();
    let offs: Vec<_> = evs
        .iter()
        .filter_map(|e| match e {
            KEvent::Sched(s) if s.tid == tid => Some(s),
            _ => None,
        })
        .collect();
    let around_20ms: Vec<_> = offs
        .iter()
        .filter(|s| {
            let off = s.ts_ns - s.off_ns;
            (19_000_000..60_000_000).contains(&off)
        })
        .collect();
    assert!(around_20ms.len() >= 4, "expected ~5 off-CPU intervals of ~20 ms for tid {tid}, got {offs:#?}");
    for s in &around_20ms {
        assert_eq!(s.tgid, pid);
        assert_ne!(s.prev_state, 0, "a sleep is not a preemption");
        let wake = s.wake_ns.unwrap_or_else(|| panic!("the sleeper was woken: {s:?} has no wake-up; its intervals: {offs:#?}; counters: {:?}", src.stats()));
        assert!(s.off_ns < wake && wake <= s.ts_ns, "{s:?}");
    }
    // Nothing below the threshold is sent; it is aggregated instead.
    for e in &evs {
        if let KEvent::Sched(s) = e {
            assert!(s.ts_ns - s.off_ns >= 5_000_000, "{s:?}");
        }
    }
    let st = src.stats();
    eprintln!("sched: short={:?} short_ns={:?}", st.get("kernel_sched_short"), st.get("kernel_sched_short_ns"));
    st
}

/// A process that sleeps only ~0.3 ms between writes (too short for an
/// off-CPU record: under `min_offcpu_ns`) still has each unix-socket write
/// say which wake-up it came after: the one its parent's pipe write made,
/// stamped on both sides of that write. (Two processes, not two threads:
/// a thread woken from its read would wait for the GIL, a second sleep.)
#[test]
fn a_unix_write_after_a_short_sleep_carries_the_wake_up_that_ended_it() {
    let Some(_serial) = privileged("a_unix_write_after_a_short_sleep_carries_the_wake_up_that_ended_it") else { return };
    let py = Py::spawn(
        r#"
a, b = socket.socketpair()
r, w = os.pipe()
out("ready")
wait_go()
child = os.fork()
if child == 0:
    for i in range(20):
        os.read(r, 1)                     # a pipe: no io record
        a.send(b"burst-%02d" % i)
    os._exit(0)
marks = []
time.sleep(0.05)
for i in range(20):
    time.sleep(0.0003)                    # the child is back in read()
    t0 = time.monotonic_ns(); os.write(w, b"x"); t1 = time.monotonic_ns()
    assert b.recv(100) == b"burst-%02d" % i
    marks.append("%d:%d" % (t0, t1))
os.waitpid(child, 0)
out("done", child, *marks)
"#,
    );
    let Traced { done, pid, evs, .. } = py.traced(|_| {});
    let child: u32 = done[0].parse().unwrap();
    let marks: Vec<(u64, u64)> = done[1..]
        .iter()
        .map(|m| {
            let (a, b) = m.split_once(':').unwrap();
            (a.parse().unwrap(), b.parse().unwrap())
        })
        .collect();
    let offcpu_ends: Vec<u64> = evs
        .iter()
        .filter_map(|e| match e {
            KEvent::Sched(s) if s.tid == child => Some(s.ts_ns),
            _ => None,
        })
        .collect();
    let (mut exact, mut unseen) = (0, 0);
    for (i, &(t0, t1)) in marks.iter().enumerate() {
        let io = find_io(&evs, child, Syscall::Sendto, format!("burst-{i:02}").as_bytes());
        let Burst::Woken { wake_ns: wake, on_ns: on } = io.burst else { panic!("write {i} carries no burst: {io:?}") };
        assert!(wake <= on && on <= io.enter_ns, "write {i}: wake {wake}, switch-in {on}, syscall entry {}", io.enter_ns);
        // The child may not have been back asleep yet (then its burst is
        // the previous wake-up's): most writes, not all.
        if (t0..=t1).contains(&wake) {
            exact += 1;
        } else {
            assert!(wake < t0, "write {i}: a wake-up after the send that woke it ({wake} > {t1})");
        }
        if !offcpu_ends.contains(&on) {
            unseen += 1;
        }
    }
    eprintln!("{exact} of 20 short-sleep writes timed from their own wake-up; {unseen} after a sleep no off-CPU record shows");
    assert!(exact >= 15, "{exact} of 20 writes name the wake-up the pipe write made");
    assert!(unseen >= 5, "the sleeps were meant to be shorter than min_offcpu_ns: {unseen} of 20 unseen");
    let reads: Vec<_> = ios(&evs, pid).into_iter().filter(|io| io.dir == Dir::In).collect();
    assert_eq!(reads.len(), 20, "the parent's reads");
    assert!(reads.iter().all(|io| io.burst == Burst::NoSleep), "reads carry none");
}

/// A thread asleep since before the attach has no switch-out the probes saw,
/// yet its first wake-up after the attach is the hand-over its next write
/// needs (the first request after `record --pid` on an idle server: ZMQ's
/// I/O thread has sat in epoll_wait since long before). The child blocks in
/// read() before the script says `ready`, so before the probes exist.
#[test]
fn a_write_by_a_thread_asleep_since_before_the_attach_carries_its_first_wake_up() {
    let Some(_serial) = privileged("a_write_by_a_thread_asleep_since_before_the_attach_carries_its_first_wake_up") else { return };
    write_after_a_sleep_from_before_the_attach(false);
}

/// The same when the slot cannot be allocated at that first wake-up: the
/// wake-up is spilled and still reaches the write. The failure is injected.
#[test]
fn a_first_wake_up_whose_slot_cannot_be_allocated_still_reaches_the_write() {
    let Some(_serial) = privileged("a_first_wake_up_whose_slot_cannot_be_allocated_still_reaches_the_write") else { return };
    let st = write_after_a_sleep_from_before_the_attach(true);
    assert!(st.get("kernel_sched_spilled").unwrap() >= 1, "{st:?}");
    assert_eq!(st.get("kernel_sched_map_full"), Some(0), "{st:?}");
}

fn write_after_a_sleep_from_before_the_attach(fail_offcpu_alloc: bool) -> hopscope::source::ebpf::KernelStats {
    let py = Py::spawn(
        r#"
a, b = socket.socketpair()
r, w = os.pipe()
child = os.fork()
if child == 0:
    os.read(r, 1)                         # asleep from here, before the attach
    a.send(b"first-after-attach")
    os._exit(0)
time.sleep(0.2)
out("ready", child)
wait_go()
time.sleep(0.05)
t0 = time.monotonic_ns(); os.write(w, b"x"); t1 = time.monotonic_ns()
assert b.recv(100) == b"first-after-attach"
os.waitpid(child, 0)
out("done", t0, t1)
"#,
    );
    let Traced { ready, done, evs, src, .. } = py.traced(|c| c.fail_offcpu_alloc = fail_offcpu_alloc);
    let child: u32 = ready[0].parse().unwrap();
    let (t0, t1): (u64, u64) = (done[0].parse().unwrap(), done[1].parse().unwrap());
    let io = find_io(&evs, child, Syscall::Sendto, b"first-after-attach");
    let Burst::Woken { wake_ns: wake, on_ns: on } = io.burst else { panic!("the first write after the attach carries no burst: {io:?}") };
    assert!((t0..=t1).contains(&wake), "its wake-up {wake} is the pipe write's, within [{t0}, {t1}]");
    assert!(wake <= on && on <= io.enter_ns, "wake {wake}, switch-in {on}, syscall entry {}", io.enter_ns);
    src.stats()
}

#[test]
fn a_spawned_command_is_traced_from_its_first_syscall() {
    let Some(_serial) = privileged("a_spawned_command_is_traced_from_its_first_syscall") else { return };
    let mut src = start(vec![], |c| c.enable_bpf_stats = true);
    // No `go` handshake: the very first socket I/O of the program must be seen.
    let mut cmd = Command::new("python3");
    cmd.args(["-c", "import socket; a, b = socket.socketpair(); a.send(b'first-bytes'); b.recv(64)"]);
    let mut child = src.spawn(cmd).unwrap_or_else(|e| panic!("spawn: {}", chain(&e)));
    let pid = child.id();
    assert!(child.wait().unwrap().success());
    let evs = collect(&mut src);
    let exec = evs
        .iter()
        .find_map(|e| match e {
            KEvent::Proc(p) if p.op == ProcOp::Exec && p.tgid == pid => Some(p),
            _ => None,
        })
        .expect("exec event of the spawned child");
    assert!(exec.comm.starts_with("python3"), "{exec:?}");
    let sent = find_io(&evs, pid, Syscall::Sendto, b"first-bytes");
    assert_eq!(sent.wire_ns, None, "a unix socket's bytes pass no device: {sent:?}");
    find_io(&evs, pid, Syscall::Recvfrom, b"first-bytes");

    let progs = src.program_stats();
    assert_eq!(progs.len(), 33, "{progs:?}");
    let (_, cnt, ns) = progs.iter().find(|(n, _, _)| n == "sys_exit_sendto").unwrap();
    assert!(*cnt >= 1 && *ns > 0, "bpf stats enabled but sys_exit_sendto ran {cnt} times in {ns} ns");
    for (name, cnt, ns) in &progs {
        if *cnt > 0 {
            eprintln!("  {name:<22} runs {cnt:>8}  avg {:>6} ns", ns / cnt);
        }
    }
}

#[test]
fn spawn_of_a_missing_program_fails_without_hanging() {
    let Some(_serial) = privileged("spawn_of_a_missing_program_fails_without_hanging") else { return };
    let mut src = start(vec![], |_| {});
    let err = src.spawn(Command::new("/nonexistent/hopscope-test-binary")).unwrap_err();
    assert!(matches!(err, SourceError::Io { .. }), "{err:?}");
}

#[test]
fn start_rejects_a_missing_pid_and_an_oversized_capture_but_accepts_extreme_globals() {
    let Some(_serial) = privileged("start_rejects_a_missing_pid_and_an_oversized_capture_but_accepts_extreme_globals") else { return };
    let pid = 0x3fff_fff0;
    match EbpfSource::start(EbpfConfig { pids: vec![pid], ..EbpfConfig::default() }) {
        Err(SourceError::PidNotFound(p)) => assert_eq!(p, pid),
        Err(e) => panic!("wrong error: {}", chain(&e)),
        Ok(_) => panic!("started with a missing pid"),
    }
    let err = EbpfSource::start(EbpfConfig { capture_len: 1 << 20, ..EbpfConfig::default() }).err().unwrap();
    assert!(matches!(err, SourceError::InvalidConfig(_)), "{err:?}");
    let err = EbpfSource::start(EbpfConfig { capture_len_unix: 32769, ..EbpfConfig::default() }).err().unwrap();
    assert!(matches!(&err, SourceError::InvalidConfig(m) if m.contains("capture_len_unix")), "{err:?}");
    // 64 KiB cannot hold 16 records of the default 32 KiB unix capture.
    let err = EbpfSource::start(EbpfConfig { ringbuf_bytes: 64 << 10, ..EbpfConfig::default() }).err().unwrap();
    assert!(matches!(&err, SourceError::InvalidConfig(m) if m.contains("ringbuf_bytes")), "{err:?}");
    // The extremes of the globals still pass the verifier.
    drop(start(vec![], |c| {
        c.capture_len = 0;
        c.capture_len_unix = 0;
        c.min_offcpu_ns = 0;
        c.wakeup_bytes = u64::MAX;
    }));
    drop(start(vec![], |c| {
        c.capture_len = 32768;
        c.capture_len_unix = 32768;
        c.capture_tail = 16384; // HS_MAX_TAIL
        c.capture_tail_unix = 16384;
    }));
    let err = EbpfSource::start(EbpfConfig { capture_tail: 16385, ..EbpfConfig::default() }).err().unwrap();
    assert!(matches!(&err, SourceError::InvalidConfig(m) if m.contains("capture_tail")), "{err:?}");
}

#[test]
fn full_capture_of_4096_bytes_is_exact_for_one_buffer_and_for_iovecs() {
    let Some(_serial) = privileged("full_capture_of_4096_bytes_is_exact_for_one_buffer_and_for_iovecs") else { return };
    let py = Py::spawn(
        r#"
a, b = socket.socketpair()
a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
out("ready")
wait_go()
blob = bytes(i % 251 for i in range(6000))
a.sendall(blob)
got = b""
while len(got) < 6000:
    got += b.recv(65536)
os.writev(a.fileno(), [blob[:3000], blob[3000:]])
got = b""
while len(got) < 6000:
    got += b.recv(65536)
out("done")
"#,
    );
    // Prefixes only: the last bytes of a longer transfer are another test's.
    let Traced { pid, evs, .. } = py.traced(|c| {
        c.capture_len_unix = 4096;
        c.capture_tail_unix = 0;
    });
    let blob: Vec<u8> = (0..6000u32).map(|i| (i % 251) as u8).collect();
    let one = find_io(&evs, pid, Syscall::Sendto, &blob[..4096]);
    assert_eq!((one.len, one.gap()), (6000, 1904));
    let iov = find_io(&evs, pid, Syscall::Writev, &blob[..4096]);
    assert_eq!((iov.len, iov.gap()), (6000, 1904));
}

#[test]
fn unix_sockets_capture_32_kib_while_tcp_keeps_4_kib_by_default() {
    let Some(_serial) = privileged("unix_sockets_capture_32_kib_while_tcp_keeps_4_kib_by_default") else { return };
    let py = Py::spawn(
        r#"
a, b = socket.socketpair()
a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
l = socket.socket()
l.bind(("127.0.0.1", 0))
l.listen()
c = socket.create_connection(l.getsockname())
s, _ = l.accept()
out("ready")
wait_go()
blob = bytes(i % 251 for i in range(40000))
def drain(sock, n, piece=32768):
    got = 0
    while got < n:
        got += len(sock.recv(min(n - got, piece), socket.MSG_WAITALL))
assert os.write(a.fileno(), blob) == 40000
drain(b, 40000)
# Two iovecs: the second starts at 20000, so it is cut at the 32 KiB mark.
assert os.writev(a.fileno(), [blob[:20000], blob[20000:]]) == 40000
drain(b, 40000)
c.sendall(blob[:6000])
drain(s, 6000)
# hyper's writev of an SSE burst (vLLM 0.34.0's Rust frontend): the head, then two Responses API
# events of ~4300 bytes (long instructions echoed), three iovecs each.
evs = [b"event: response.created\ndata: " + b"c" * 4269 + b"\n\n", b"event: response.in_progress\ndata: " + b"p" * 4273 + b"\n\n"]
burst = [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"] + [p for e in evs for p in (b"%X\r\n" % len(e), e, b"\r\n")]
assert os.writev(c.fileno(), burst) == sum(map(len, burst))
drain(s, sum(map(len, burst)))
# One over the prefix and the tail together: its middle is a gap.
c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
assert os.writev(c.fileno(), [blob[:3000], blob[3000:6000], blob[:4000], blob[:20000]]) == 30000
drain(s, 30000, 16384)  # reads under 4 KiB + 16 KiB: whole
out("done")
"#,
    );
    let Traced { pid, src, evs, .. } = py.traced(|_| {});
    let blob: Vec<u8> = (0..40000u32).map(|i| (i % 251) as u8).collect();
    // One buffer or iovecs: the prefix, then the last 4 KiB.
    let one = find_io(&evs, pid, Syscall::Write, &blob[..32768]);
    assert_eq!((one.family, one.len, one.gap()), (Family::Unix, 40000, 40000 - 32768 - 4096));
    assert_eq!(one.tail, blob[40000 - 4096..]);
    let iov = find_io(&evs, pid, Syscall::Writev, &blob[..32768]);
    assert_eq!((iov.family, iov.len, iov.gap()), (Family::Unix, 40000, 40000 - 32768 - 4096));
    assert_eq!(iov.tail, blob[40000 - 4096..]);
    // Reads of 32 KiB are whole.
    let reads: Vec<&IoEvent> = ios(&evs, pid).into_iter().filter(|io| io.family == Family::Unix && io.dir == Dir::In).collect();
    assert_eq!(reads.iter().map(|io| io.len).sum::<u64>(), 80000, "{reads:?}");
    assert!(reads.iter().all(|io| io.gap() == 0), "{:?}", reads.iter().map(|io| (io.len, io.gap())).collect::<Vec<_>>());
    // TCP: a 4 KiB prefix, and the rest (under the 16 KiB TCP tail) after it.
    let tcp = find_io(&evs, pid, Syscall::Sendto, &blob[..4096]);
    assert_eq!((tcp.family, tcp.len, tcp.gap()), (Family::Inet, 6000, 0));
    assert_eq!(tcp.tail, blob[4096..6000]);
    // hyper's burst: the 4 KiB prefix and the tail meet, the second event's chunk-size line
    // (past 4 KiB) and the body's last bytes with them.
    let event = |name: &str, fill: u8, n: usize| [format!("event: {name}\ndata: ").into_bytes(), vec![fill; n], b"\n\n".to_vec()].concat();
    let (created, progress) = (event("response.created", b'c', 4269), event("response.in_progress", b'p', 4273));
    let mut burst = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
    for e in [created, progress] {
        burst.extend_from_slice(format!("{:X}\r\n", e.len()).as_bytes());
        burst.extend_from_slice(&e);
        burst.extend_from_slice(b"\r\n");
    }
    let sse = find_io(&evs, pid, Syscall::Writev, &burst[..4096]);
    assert_eq!((sse.family, sse.len, sse.gap()), (Family::Inet, burst.len() as u64, 0));
    assert_eq!(sse.tail, burst[4096..]);
    // 30000 bytes in 4 iovecs: 4 KiB, a gap, and the last 16 KiB (out of the last iovec).
    let long = find_io(&evs, pid, Syscall::Writev, &blob[..4096]);
    assert_eq!((long.len, long.gap()), (30000, 30000 - 4096 - 16384));
    assert_eq!(long.tail, blob[20000 - 16384..20000]);
    for io in ios(&evs, pid).into_iter().filter(|io| io.family == Family::Inet) {
        assert!(io.data.len() <= 4096, "TCP capture grew: {io:?}");
    }
    // The two unix writes and the long TCP writev; the other TCP sends and their reads lost nothing.
    assert_eq!(src.stats().get("kernel_truncated"), Some(3));
}

/// Minimal msgpack for the ADD messages below.
mod mp {
    pub fn str(o: &mut Vec<u8>, s: &str) {
        assert!(s.len() < 32);
        o.push(0xa0 | s.len() as u8);
        o.extend_from_slice(s.as_bytes());
    }
    pub fn uint(o: &mut Vec<u8>, v: u32) {
        match v {
            0..=127 => o.push(v as u8),
            128..=0xffff => {
                o.push(0xcd);
                o.extend_from_slice(&(v as u16).to_be_bytes());
            }
            _ => {
                o.push(0xce);
                o.extend_from_slice(&v.to_be_bytes());
            }
        }
    }
    pub fn array(o: &mut Vec<u8>, n: usize) {
        if n < 16 {
            o.push(0x90 | n as u8);
        } else {
            o.push(0xdc);
            o.extend_from_slice(&(n as u16).to_be_bytes());
        }
    }
    pub fn nil(o: &mut Vec<u8>) {
        o.push(0xc0);
    }
    pub fn f64(o: &mut Vec<u8>, v: f64) {
        o.push(0xcb);
        o.extend_from_slice(&v.to_be_bytes());
    }
}

/// A ZMTP frame (short or long form).
fn zframe(body: &[u8], more: bool) -> Vec<u8> {
    let mut f = Vec::new();
    if body.len() < 256 {
        f.extend_from_slice(&[more as u8, body.len() as u8]);
    } else {
        f.push(0x02 | more as u8);
        f.extend_from_slice(&(body.len() as u64).to_be_bytes());
    }
    f.extend_from_slice(body);
    f
}

/// The frontend's side of vLLM's input socket: greeting and READY (ROUTER).
fn zmtp_handshake() -> Vec<u8> {
    let mut g = vec![0xff, 0, 0, 0, 0, 0, 0, 0, 0x01, 0x7f, 3, 1];
    let mut mech = b"NULL".to_vec();
    mech.resize(20, 0);
    g.extend_from_slice(&mech);
    g.extend_from_slice(&[0; 32]);
    let mut body = vec![5];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&6u32.to_be_bytes());
    body.extend_from_slice(b"ROUTER");
    g.extend_from_slice(&[0x04, body.len() as u8]);
    g.extend_from_slice(&body);
    g
}

/// An ADD (request type 0x00 + a vLLM 0.33.0 `EngineCoreRequest`) with
/// `prompt` token ids of 5 msgpack bytes each (ids ≥ 65536, as in a 128 K
/// vocabulary): ~5 bytes per token on the wire.
fn zmtp_add(ext: &str, prompt: usize) -> Vec<u8> {
    let mut b = Vec::new();
    mp::array(&mut b, 22);
    mp::str(&mut b, &format!("{ext}-0000abcd"));
    mp::array(&mut b, prompt);
    for i in 0..prompt {
        mp::uint(&mut b, 100_000 + i as u32);
    }
    mp::nil(&mut b); // mm_features
    b.push(0x83); // sampling_params: {temperature: 0.0, stop: [], max_tokens: 200 + prompt % 50}
    mp::str(&mut b, "temperature");
    mp::f64(&mut b, 0.0);
    mp::str(&mut b, "stop");
    mp::array(&mut b, 0);
    mp::str(&mut b, "max_tokens");
    mp::uint(&mut b, 200 + (prompt % 50) as u32);
    mp::nil(&mut b); // pooling_params
    mp::f64(&mut b, 1_800_000_000.25); // arrival_time
    mp::nil(&mut b);
    mp::nil(&mut b);
    mp::uint(&mut b, 1); // data_parallel_rank
    mp::nil(&mut b);
    mp::nil(&mut b);
    for _ in 0..3 {
        mp::uint(&mut b, 0);
    }
    mp::nil(&mut b); // trace_headers
    b.push(0xc2); // resumable
    mp::str(&mut b, ext); // external_req_id
    mp::nil(&mut b);
    mp::nil(&mut b);
    b.push(0xc2);
    mp::nil(&mut b);
    mp::nil(&mut b);
    let mut w = zframe(&[0x00], true);
    w.extend(zframe(&b, false));
    w
}

/// (dir, request id, external id, prompt tokens, max tokens, arrival, truncated) of an ADD.
type Add = (Dir, String, Option<String>, Option<u64>, Option<u64>, Option<f64>, bool);

struct IpcRun {
    adds: Vec<Add>,
    /// The writer's ADDs that said they began in an earlier write.
    started_out: Vec<String>,
    counters: Vec<(&'static str, u64)>,
    kernel_truncated: u64,
}

impl IpcRun {
    fn counter(&self, name: &str) -> u64 {
        self.counters.iter().find(|(n, _)| *n == name).unwrap_or_else(|| panic!("no counter {name}")).1
    }
}

/// One traced process writes `writes` (`(syscall, bytes)`, `sendmsg` split
/// into two iovecs) into one end of a socketpair and reads each back from the
/// other in pieces of at most 32 KiB; both ends are decoded as vLLM IPC.
fn ipc_run(name: &str, capture_unix: u32, tail_unix: u32, writes: &[(&str, Vec<u8>)]) -> IpcRun {
    use hopscope::model::Record;
    use hopscope::proto::{DecoderConfig, WireDecoder};
    let dir = std::env::temp_dir().join(format!("hopscope-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut plan = String::new();
    for (i, (how, bytes)) in writes.iter().enumerate() {
        std::fs::write(dir.join(format!("w{i}.bin")), bytes).unwrap();
        plan.push_str(&format!("({how:?}, {:?}),", dir.join(format!("w{i}.bin")).display().to_string()));
    }
    let py = Py::spawn(&format!(
        r#"
a, b = socket.socketpair()
a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
plan = [{plan}]
chunks = [(how, open(path, "rb").read()) for how, path in plan]
out("ready")
wait_go()
for how, data in chunks:
    if how == "write":
        assert os.write(a.fileno(), data) == len(data)
    else:
        k = len(data) // 3 + 1
        assert a.sendmsg([data[:k], data[k:]]) == len(data)
    got = 0
    while got < len(data):
        got += len(b.recv(min(len(data) - got, 32768), socket.MSG_WAITALL))
out("done")
"#
    ));
    let Traced { pid, src, mut evs, .. } = py.traced(|c| {
        c.capture_len_unix = capture_unix;
        c.capture_tail_unix = tail_unix;
    });
    let _ = std::fs::remove_dir_all(&dir);
    evs.retain(|e| matches!(e, KEvent::Io(io) if io.conn.tgid == pid));
    evs.sort_by_key(|e| match e {
        KEvent::Io(io) => io.ts_ns,
        _ => unreachable!(),
    });
    let mut dec = WireDecoder::new(DecoderConfig::default());
    let mut out = Vec::new();
    for e in &evs {
        dec.on_event(e, &mut out);
    }
    dec.finish(&mut out);
    let started_out = out
        .iter()
        .filter_map(|r| match r {
            Record::EngineRequestStart { dir: Dir::Out, request_id, first_ns, ts_ns, .. } if first_ns < ts_ns => Some(request_id.clone()),
            _ => None,
        })
        .collect();
    let adds = out
        .into_iter()
        .filter_map(|r| match r {
            Record::EngineRequest { dir, request_id, external_req_id, prompt_tokens, max_tokens, arrival_time_s, truncated, .. } => {
                Some((dir, request_id, external_req_id, prompt_tokens, max_tokens, arrival_time_s, truncated))
            }
            _ => None,
        })
        .collect();
    IpcRun { adds, started_out, counters: dec.counters(), kernel_truncated: src.stats().get("kernel_truncated").unwrap() }
}

/// The demo's lost link: libzmq batches messages into writes of up to 8 KiB,
/// so a large ADD and the start of the next message leave in one write. A
/// 4 KiB capture cuts the next message's frame header (a desync, that message
/// lost); the 32 KiB unix capture keeps it. Past 32 KiB (libzmq writes the
/// rest of a large message alone) the write's last 4 KiB, captured apart,
/// keep that message's fields after its prompt ids.
#[test]
fn a_large_ipc_message_and_the_next_in_the_same_write_are_both_decoded() {
    let Some(_serial) = privileged("a_large_ipc_message_and_the_next_in_the_same_write_are_both_decoded") else { return };
    let a = zmtp_add("chatcmpl-a", 1200); // ~6 KB
    let b = zmtp_add("chatcmpl-b", 10);
    let c = zmtp_add("chatcmpl-c", 5000); // ~25 KB
    let d = zmtp_add("chatcmpl-d", 20);
    let e = zmtp_add("chatcmpl-e", 9500); // ~47 KB: an 8 KiB batch, then 39 KB alone
    let f = zmtp_add("chatcmpl-f", 30);
    assert!(a.len() > 4096 && a.len() + b.len() < 8192, "{}", a.len());
    // E's second write has bytes neither its 32 KiB prefix nor its 4 KiB tail holds.
    assert!(c.len() + d.len() < 32768 && e.len() - 8192 > 32768 + 4096 + 1000, "{} {}", c.len(), e.len());
    let writes = vec![
        ("write", zmtp_handshake()),
        ("write", [a, b].concat()),
        ("sendmsg", [c, d].concat()),
        ("write", e[..8192].to_vec()),
        ("write", e[8192..].to_vec()),
        ("write", f),
    ];
    let want = |ext: &str, prompt: u64| (format!("{ext}-0000abcd"), Some(ext.to_owned()), Some(prompt), Some(200 + prompt % 50), Some(1_800_000_000.25), false);
    let full = [want("chatcmpl-a", 1200), want("chatcmpl-b", 10), want("chatcmpl-c", 5000), want("chatcmpl-d", 20), want("chatcmpl-e", 9500), want("chatcmpl-f", 30)];
    let side = |run: &IpcRun, dir: Dir| -> Vec<_> {
        run.adds.iter().filter(|x| x.0 == dir).map(|x| (x.1.clone(), x.2.clone(), x.3, x.4, x.5, x.6)).collect()
    };

    let run = ipc_run("ipc-32k", 32768, 4096, &writes);
    // The reader's pieces are at most 32 KiB: it sees every byte.
    assert_eq!(side(&run, Dir::In), full);
    // The writer's 39 KB write is cut in the middle of E's prompt ids: its
    // last 4 KiB still bring E's fields after them.
    assert_eq!(side(&run, Dir::Out), full);
    assert_eq!(run.kernel_truncated, 1, "only E's 39 KB write exceeds 32 KiB + 4 KiB");
    for (name, v) in [("zmtp_desync", 0), ("zmtp_messages_lost", 0), ("zmtp_resyncs", 0), ("ipc_add", 12), ("ipc_messages", 12), ("zmtp_gap_frames", 1), ("ipc_truncated_fields", 0)] {
        assert_eq!(run.counter(name), v, "{name}: {:?}", run.counters);
    }
    // A and C fit in the frame's kept 40 KiB and are read whole from it; E,
    // longer, on both sides: its fields after the prompt ids come from its tail.
    assert_eq!(run.counter("ipc_tail_recovered"), 2, "{:?}", run.counters);
    // E alone spans writes: its hand-over is its first write's.
    assert_eq!(run.started_out, ["chatcmpl-e-0000abcd"]);

    // Without the tail (as before it was captured): E keeps its id and
    // prompt length only on the writer's side.
    let head_only = ipc_run("ipc-32k-no-tail", 32768, 0, &writes);
    assert_eq!(side(&head_only, Dir::In), full);
    let mut out_side = full.to_vec();
    out_side[4] = ("chatcmpl-e-0000abcd".into(), None, Some(9500), None, None, true);
    assert_eq!(side(&head_only, Dir::Out), out_side);
    // E's five fields after the prompt ids, and its priority (read since
    // session 44).
    for (name, v) in [("ipc_truncated_fields", 6), ("ipc_tail_recovered", 1)] {
        assert_eq!(head_only.counter(name), v, "{name}: {:?}", head_only.counters);
    }

    // The same bytes under the old 4 KiB capture, prefixes only: B's header
    // is cut (a desync in each direction); C+D's write is cut at D's header
    // too, so C is no safe resync point; the stream picks up at E.
    let old = ipc_run("ipc-4k", 4096, 0, &writes);
    for dir in [Dir::Out, Dir::In] {
        let mine: Vec<&str> = old.adds.iter().filter(|x| x.0 == dir).map(|x| x.1.as_str()).collect();
        assert_eq!(mine, ["chatcmpl-a-0000abcd", "chatcmpl-e-0000abcd", "chatcmpl-f-0000abcd"], "{dir:?}");
    }
    for (name, v) in [("zmtp_desync", 2), ("zmtp_resyncs", 2), ("ipc_add", 6)] {
        assert_eq!(old.counter(name), v, "{name}: {:?}", old.counters);
    }
    assert!(old.counter("zmtp_messages_lost") >= 2, "{:?}", old.counters);
}

#[test]
fn a_full_ring_buffer_counts_lost_records_and_forced_wakeups() {
    let Some(_serial) = privileged("a_full_ring_buffer_counts_lost_records_and_forced_wakeups") else { return };
    let mut py = Py::spawn(
        r#"
a, b = socket.socketpair()
out("ready")
wait_go()
for i in range(400):
    a.send(b"x" * 100)
    b.recv(100)
out("done")
"#,
    );
    py.line("ready");
    // One page of ring: a few dozen records fit, the rest must be counted.
    // 100-byte sends: 128-byte captures lose nothing, and 16 such records fit.
    let mut src = start(vec![py.pid()], |c| {
        c.ringbuf_bytes = 4096;
        c.capture_len = 128;
        c.capture_len_unix = 128;
        c.capture_tail_unix = 0;
        c.capture_tail = 0;
        c.wakeup_bytes = 0;
    });
    py.go();
    py.line("done");
    py.finish();
    let delivered = collect(&mut src).len() as u64;
    let st = src.stats();
    let lost = st.get("kernel_ringbuf_full").unwrap();
    assert!(lost > 0, "{st:?}");
    assert!(delivered + lost >= 800, "delivered {delivered} + lost {lost} < 800 io records");
    assert!(st.get("kernel_wakeups").unwrap() > 0, "wakeup_bytes = 0 must force wake-ups: {st:?}");
}

/// Not a check: prints per-program cost for a socket-heavy target
/// (`cargo test -p hopscope-integration --release --test ebpf_capture -- --ignored --nocapture`).
#[test]
#[ignore]
fn measure_program_cost() {
    let Some(_serial) = privileged("measure_program_cost") else { return };
    let body = r#"
a, b = socket.socketpair()
out("ready")
wait_go()
t = time.perf_counter()
for i in range(20000):
    a.send(b"y" * 512)
    b.recv(512)
out("done", (time.perf_counter() - t) / 20000 * 1e9)
"#;
    let mut base = Py::spawn(body);
    base.line("ready");
    base.go();
    let untraced: f64 = base.line("done")[0].parse().unwrap();
    base.finish();

    let mut py = Py::spawn(body);
    py.line("ready");
    let mut src = start(vec![py.pid()], |c| {
        c.enable_bpf_stats = true;
        if let Some(w) = std::env::var("HS_WAKEUP_BYTES").ok().and_then(|v| v.parse().ok()) {
            c.wakeup_bytes = w;
        }
    });
    let before = src.program_stats();
    py.go();
    // Read the target's `done` line on a helper thread while this one drains
    // the ring like the agent does (wake-ups plus a 50 ms timer).
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let traced: f64 = py.line("done")[0].parse().unwrap();
        py.finish();
        tx.send(traced).unwrap();
    });
    let mut n = 0;
    let traced = loop {
        n += src.poll(Duration::from_millis(50), |ev| drop(ev.unwrap())).unwrap();
        if let Ok(t) = rx.try_recv() {
            break t;
        }
    };
    reader.join().unwrap();
    n += collect(&mut src).len();
    let st = src.stats();
    eprintln!(
        "send+recv pair: untraced {untraced:.0} ns, traced {traced:.0} ns ({n} events, {} lost, {} forced wake-ups)",
        st.get("kernel_ringbuf_full").unwrap(),
        st.get("kernel_wakeups").unwrap()
    );
    for ((name, c1, t1), (_, c0, t0)) in src.program_stats().iter().zip(&before) {
        if c1 > c0 {
            eprintln!("  {name:<22} runs {:>8}  avg {:>6} ns", c1 - c0, (t1 - t0) / (c1 - c0));
        }
    }
}
