//! Host program for the CUPTI ABI test double: plays "the application" and
//! "the CUDA driver" in one real process.
//!
//! As the driver does with `CUDA_INJECTION64_PATH`, it loads that library and
//! calls `InitializeInjection`; then it runs steps, printing one line per
//! step (`HOST {json}`) on stdout:
//!
//! - `run:N`: the application emits N synthetic records through the double
//!   (`CUPTI_ABI_TEST_DOUBLE` = the double's path);
//! - `run-until:PATH:CHUNK:PAUSE_US`: emits records in chunks of CHUNK,
//!   PAUSE_US apart, until PATH exists, a line per chunk
//!   (`{"step":"chunk","t0":..,"t1":..,"placed":..}`, CLOCK_MONOTONIC ns
//!   around it): the application's speed, moment by moment. The pause is the
//!   rest of a real application's work (no GPU emits a record per 3 µs of
//!   one CPU's time), in which the library and the agent catch up;
//! - `wait-delivered:MS`: waits until every record reached the library;
//! - `wait-file:PATH`: waits (≤ 60 s) until PATH exists;
//! - `sleep:MS`;
//! - `wait-term:MS`: waits (≤ MS) for a SIGTERM, which then ends the program
//!   the normal way (SIGTERM is blocked from the start when this step is
//!   there): a server shutting down when asked to.
//!
//! Then it returns from main: exit() runs the library's atexit flush.

use std::ffi::{c_char, c_int, CStr, CString};
use std::io::Write;
use std::time::{Duration, Instant};

fn say(line: &str) {
    let mut o = std::io::stdout().lock();
    let _ = writeln!(o, "HOST {line}");
    let _ = o.flush();
}

/// CLOCK_MONOTONIC in ns: the clock a test that signals the agent reads too.
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn open(path: &str) -> *mut libc::c_void {
    let c = CString::new(path).expect("path without NUL");
    // SAFETY: dlopen with a valid C string; the handle is never closed.
    let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if h.is_null() {
        // SAFETY: dlerror returns a thread-local C string or null.
        let e = unsafe { libc::dlerror() };
        let msg = if e.is_null() { "unknown".into() } else { unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned() };
        panic!("dlopen {path}: {msg}");
    }
    h
}

fn sym(h: *mut libc::c_void, name: &str) -> *mut libc::c_void {
    let c = CString::new(name).unwrap();
    // SAFETY: valid handle and C string.
    let p = unsafe { libc::dlsym(h, c.as_ptr()) };
    assert!(!p.is_null(), "symbol {name} missing");
    p
}

fn main() {
    let steps: Vec<String> = std::env::args().skip(1).collect();
    // SAFETY: a zeroed sigset_t filled by sigemptyset/sigaddset, then passed
    // to sigprocmask; blocking SIGTERM here, before any thread starts, keeps
    // it pending for `wait-term`.
    let term = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        if steps.iter().any(|s| s.starts_with("wait-term:")) {
            libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        }
        set
    };
    if let Ok(inj) = std::env::var("CUDA_INJECTION64_PATH") {
        let h = open(&inj);
        // SAFETY: InitializeInjection is `extern "C" fn() -> int` by the CUDA injection contract.
        let init: extern "C" fn() -> c_int = unsafe { std::mem::transmute(sym(h, "InitializeInjection")) };
        let t = Instant::now();
        let rc = init();
        say(&format!("{{\"step\":\"init\",\"rc\":{rc},\"ns\":{},\"pid\":{}}}", t.elapsed().as_nanos(), std::process::id()));
    }
    if steps.is_empty() {
        return;
    }
    let dbl = std::env::var("CUPTI_ABI_TEST_DOUBLE").expect("CUPTI_ABI_TEST_DOUBLE: path of the double");
    let h = open(&dbl);
    // SAFETY: the double exports these with exactly these signatures.
    let run: unsafe extern "C" fn(u64, *mut c_char, usize) -> i64 = unsafe { std::mem::transmute(sym(h, "cupti_abi_test_double_run")) };
    // SAFETY: as above.
    let wait: extern "C" fn(u64) -> c_int = unsafe { std::mem::transmute(sym(h, "cupti_abi_test_double_wait_delivered")) };
    for s in steps {
        let (what, arg) = s.split_once(':').unwrap_or((s.as_str(), ""));
        match what {
            "run" => {
                let n: u64 = arg.parse().expect("run:N");
                let mut buf = vec![0 as c_char; 4096];
                // SAFETY: a 4096-byte writable buffer.
                let placed = unsafe { run(n, buf.as_mut_ptr(), buf.len()) };
                // SAFETY: the double NUL-terminates within the buffer.
                let summary = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned();
                say(&format!("{{\"step\":\"run\",\"n\":{n},\"placed_now\":{placed},\"double\":{summary}}}"));
            }
            "run-until" => {
                let usage = "run-until:PATH:CHUNK:PAUSE_US";
                let (rest, pause) = arg.rsplit_once(':').expect(usage);
                let (path, chunk) = rest.rsplit_once(':').expect(usage);
                let chunk: u64 = chunk.parse().expect(usage);
                let pause = Duration::from_micros(pause.parse().expect(usage));
                let mut buf = vec![0 as c_char; 4096];
                say("{\"step\":\"run-until-start\"}");
                while !std::path::Path::new(path).exists() {
                    let t0 = monotonic_ns();
                    // SAFETY: a 4096-byte writable buffer.
                    let placed = unsafe { run(chunk, buf.as_mut_ptr(), buf.len()) };
                    let t1 = monotonic_ns();
                    say(&format!("{{\"step\":\"chunk\",\"t0\":{t0},\"t1\":{t1},\"placed\":{placed}}}"));
                    std::thread::sleep(pause);
                }
            }
            "wait-delivered" => {
                let ok = wait(arg.parse().expect("wait-delivered:MS"));
                say(&format!("{{\"step\":\"wait-delivered\",\"ok\":{}}}", ok == 1));
            }
            "wait-file" => {
                let t = Instant::now();
                while !std::path::Path::new(arg).exists() && t.elapsed() < Duration::from_secs(60) {
                    std::thread::sleep(Duration::from_millis(5));
                }
                say(&format!("{{\"step\":\"wait-file\",\"ok\":{}}}", std::path::Path::new(arg).exists()));
            }
            "sleep" => std::thread::sleep(Duration::from_millis(arg.parse().expect("sleep:MS"))),
            "wait-term" => {
                let ms: i64 = arg.parse().expect("wait-term:MS");
                let ts = libc::timespec { tv_sec: ms / 1000, tv_nsec: (ms % 1000) * 1_000_000 };
                // SAFETY: `term` holds SIGTERM, blocked since the start; a null
                // siginfo pointer is allowed.
                let sig = unsafe { libc::sigtimedwait(&term, std::ptr::null_mut(), &ts) };
                say(&format!("{{\"step\":\"wait-term\",\"ok\":{}}}", sig == libc::SIGTERM));
            }
            other => panic!("unknown step {other:?}"),
        }
    }
    say("{\"step\":\"exit\"}");
}
