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
use hopscope::event::{ConnOp, Dir, Family, IoEvent, KEvent, ProcOp, Syscall};
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

    let accept = evs
        .iter()
        .find_map(|e| match e {
            KEvent::Conn(c) if c.conn.tgid == pid && c.op == ConnOp::Accept => Some(c),
            _ => None,
        })
        .expect("accept event");
    assert_eq!(accept.family, Family::Inet);
    assert!(accept.ret >= 0 && accept.conn.fd as i64 == accept.ret);
    assert_eq!(accept.local, Some(format!("127.0.0.1:{port}").parse().unwrap()));
    assert_eq!(accept.peer, Some(client.local_addr().unwrap()));
    assert!(accept.conn.ino != 0);

    let req = find_io(&evs, pid, Syscall::Recvfrom, request);
    assert_eq!((req.dir, req.family, req.len), (Dir::In, Family::Inet, request.len() as u64));
    assert_eq!(req.conn, accept.conn, "request read on the accepted socket");
    assert!(req.enter_ns <= req.ts_ns && accept.ts_ns <= req.ts_ns);

    let resp = find_io(&evs, pid, Syscall::Sendto, &response);
    assert_eq!((resp.dir, resp.conn), (Dir::Out, accept.conn));
    assert_eq!(&response[..], b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello");

    let close = evs
        .iter()
        .find_map(|e| match e {
            KEvent::Close(c) if c.conn == accept.conn => Some(c),
            _ => None,
        })
        .expect("close of the accepted socket");
    assert!(close.ts_ns >= resp.ts_ns);

    let connect = evs
        .iter()
        .find_map(|e| match e {
            KEvent::Conn(c) if c.conn.tgid == pid && c.op == ConnOp::Connect => Some(c),
            _ => None,
        })
        .expect("connect event");
    assert_eq!(connect.ret, 0);
    assert_eq!(connect.peer, Some(format!("127.0.0.1:{agent_port}").parse().unwrap()));
    assert_eq!(connect.local, Some(upstream.peer_addr().unwrap()));
    let upw = find_io(&evs, pid, Syscall::Sendto, b"upstream-bytes");
    assert_eq!(upw.conn, connect.conn);

    let stats = src.stats();
    assert!(stats.get("kernel_events").unwrap() >= evs.len() as u64);
    assert_eq!(stats.get("kernel_ringbuf_full"), Some(0));
}

#[test]
fn unix_socketpair_bytes_are_captured_with_the_unix_family() {
    let Some(_serial) = privileged("unix_socketpair_bytes_are_captured_with_the_unix_family") else { return };
    let mut py = Py::spawn(
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
    py.line("ready");
    let mut src = start(vec![py.pid()], |_| {});
    py.go();
    assert_eq!(py.line("done"), ["unix-ping-123", "raw-write"]);
    let pid = py.pid();
    py.finish();
    let evs = collect(&mut src);

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

#[test]
fn writev_readv_sendmsg_and_recvmsg_capture_iovecs_in_order() {
    let Some(_serial) = privileged("writev_readv_sendmsg_and_recvmsg_capture_iovecs_in_order") else { return };
    let mut py = Py::spawn(
        r#"
a, b = socket.socketpair()
out("ready")
wait_go()
os.writev(a.fileno(), [b"v1-", b"", b"v2-", b"v3"])
b1, b2 = bytearray(3), bytearray(100)
n = os.readv(b.fileno(), [b1, b2])
a.sendmsg([b"m1-", b"m2-", b"m3"])
data, _, _, _ = b.recvmsg(100)
os.writev(a.fileno(), [bytes([65 + i]) for i in range(10)])
rest = b.recv(100)
out("done", n, data.decode(), rest.decode())
"#,
    );
    py.line("ready");
    let mut src = start(vec![py.pid()], |_| {});
    py.go();
    assert_eq!(py.line("done"), ["8", "m1-m2-m3", "ABCDEFGHIJ"]);
    let pid = py.pid();
    py.finish();
    let evs = collect(&mut src);

    let wv = find_io(&evs, pid, Syscall::Writev, b"v1-v2-v3");
    assert_eq!((wv.len, wv.gap()), (8, 0));
    let rv = find_io(&evs, pid, Syscall::Readv, b"v1-v2-v3");
    assert_eq!(rv.dir, Dir::In);
    find_io(&evs, pid, Syscall::Sendmsg, b"m1-m2-m3");
    find_io(&evs, pid, Syscall::Recvmsg, b"m1-m2-m3");
    // Ten one-byte iovecs: the kernel walks eight and says the rest is a gap.
    let many = find_io(&evs, pid, Syscall::Writev, b"ABCDEFGH");
    assert_eq!((many.len, many.gap()), (10, 2));
    let stats = src.stats();
    assert!(stats.get("kernel_iov_truncated").unwrap() >= 1, "{stats:?}");
    assert!(stats.get("kernel_truncated").unwrap() >= 1, "{stats:?}");
}

#[test]
fn writes_longer_than_capture_len_are_truncated_and_counted() {
    let Some(_serial) = privileged("writes_longer_than_capture_len_are_truncated_and_counted") else { return };
    let mut py = Py::spawn(
        r#"
a, b = socket.socketpair()
out("ready")
wait_go()
a.sendall(b"0123456789abcdef" * 64)
got = 0
while got < 1024:
    got += len(b.recv(4096))
out("done", got)
"#,
    );
    py.line("ready");
    let mut src = start(vec![py.pid()], |c| c.capture_len = 64);
    py.go();
    py.line("done");
    let pid = py.pid();
    py.finish();
    let evs = collect(&mut src);
    let expect: Vec<u8> = b"0123456789abcdef".repeat(4);
    let w = find_io(&evs, pid, Syscall::Sendto, &expect);
    assert_eq!((w.len, w.data.len(), w.gap()), (1024, 64, 960));
    assert!(!w.copy_failed);
    for io in ios(&evs, pid) {
        assert!(io.data.len() <= 64, "capture_len not honoured: {io:?}");
    }
    assert!(src.stats().get("kernel_truncated").unwrap() >= 1);
}

#[test]
fn a_forked_child_of_the_target_is_followed_and_its_exit_reported() {
    let Some(_serial) = privileged("a_forked_child_of_the_target_is_followed_and_its_exit_reported") else { return };
    let mut py = Py::spawn(
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
    py.line("ready");
    let mut src = start(vec![py.pid()], |_| {});
    py.go();
    let done = py.line("done");
    let child: u32 = done[0].parse().unwrap();
    assert_eq!(done[1], "from-the-child");
    let pid = py.pid();
    py.finish();
    let evs = collect(&mut src);

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
    let mut py = Py::spawn(
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
    let tid: u32 = py.line("ready")[0].parse().unwrap();
    let mut src = start(vec![py.pid()], |c| c.min_offcpu_ns = 5_000_000);
    py.go();
    py.line("done");
    let pid = py.pid();
    py.finish();
    let evs = collect(&mut src);
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
        let wake = s.wake_ns.expect("the sleeper was woken");
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
    find_io(&evs, pid, Syscall::Sendto, b"first-bytes");
    find_io(&evs, pid, Syscall::Recvfrom, b"first-bytes");

    let progs = src.program_stats();
    assert_eq!(progs.len(), 32, "{progs:?}");
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
    // The extremes of the globals still pass the verifier.
    drop(start(vec![], |c| {
        c.capture_len = 0;
        c.min_offcpu_ns = 0;
        c.wakeup_bytes = u64::MAX;
    }));
}

#[test]
fn full_capture_of_4096_bytes_is_exact_for_one_buffer_and_for_iovecs() {
    let Some(_serial) = privileged("full_capture_of_4096_bytes_is_exact_for_one_buffer_and_for_iovecs") else { return };
    let mut py = Py::spawn(
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
    py.line("ready");
    let mut src = start(vec![py.pid()], |c| c.capture_len = 4096);
    py.go();
    py.line("done");
    let pid = py.pid();
    py.finish();
    let evs = collect(&mut src);
    let blob: Vec<u8> = (0..6000u32).map(|i| (i % 251) as u8).collect();
    let one = find_io(&evs, pid, Syscall::Sendto, &blob[..4096]);
    assert_eq!((one.len, one.gap()), (6000, 1904));
    let iov = find_io(&evs, pid, Syscall::Writev, &blob[..4096]);
    assert_eq!((iov.len, iov.gap()), (6000, 1904));
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
    let mut src = start(vec![py.pid()], |c| {
        c.ringbuf_bytes = 4096;
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
