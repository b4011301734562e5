//! Support for black-box tests: start the real `iop-edge` and `iop-node` binaries with
//! temporary configs, talk to them over HTTP, and impersonate providers ([`fake`]).

pub mod client;
pub mod fake;
pub mod fleet;
pub mod kvfake;
pub mod procfs;
pub mod rogue;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// What the built-in mock answers every request of `words` words (its default reply, cycled).
pub fn mock_answer(words: usize) -> String {
    let reply = ["Hello", "from", "the", "IOP", "mock", "provider."];
    (0..words)
        .map(|i| reply[i % reply.len()])
        .collect::<Vec<_>>()
        .join(" ")
}

/// Path of a workspace binary (`iop-edge`, `iop-node`) built into the same target
/// directory as the running test. Under cargo (`cargo test`, which does not build a
/// workspace's binaries for another package's tests), the first call of a test process
/// builds them ([`build_binaries`]; a fraction of a second when they are fresh), so a
/// black-box test never runs binaries left from before a change.
#[must_use]
pub fn binary(name: &str) -> PathBuf {
    static BUILT: std::sync::Once = std::sync::Once::new();
    if name == "iop-edge" || name == "iop-node" {
        BUILT.call_once(build_binaries);
    }
    let mut dir = std::env::current_exe().expect("test executable path");
    dir.pop(); // the test binary's file name
    if dir.ends_with("deps") {
        dir.pop();
    }
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} not found: build the binaries first (cargo build --bins)",
        path.display()
    );
    path
}

/// Builds `iop-edge` and `iop-node` into this harness's target directory and profile
/// when the harness runs under `cargo run` or `cargo test` (which set `CARGO`), so that one command
/// measures the tree as it is and never binaries left from an earlier build. Run as a
/// plain executable, it leaves the binaries to the caller (`binary` says when they are
/// missing). Panics if the build fails: there is nothing to measure.
pub fn build_binaries() {
    let Some(cargo) = std::env::var_os("CARGO") else {
        return;
    };
    let mut dir = std::env::current_exe().expect("harness executable path");
    dir.pop();
    if dir.ends_with("deps") {
        dir.pop();
    }
    let profile = dir
        .file_name()
        .and_then(|p| p.to_str())
        .unwrap_or("debug")
        .to_owned();
    // Into the directory `binary` looks in: `<target dir>/<profile>`, also when the
    // harness was built for an explicit `--target` (`<target dir>/<triple>/<profile>`).
    let target_dir = dir.parent().expect("a profile directory has a parent");
    let mut build = Command::new(cargo);
    build
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .args(["build", "--quiet", "--bin", "iop-edge", "--bin", "iop-node"])
        .arg("--target-dir")
        .arg(target_dir);
    // What `cargo run` set for this harness describes the harness, not the build: left
    // in, `CARGO_MANIFEST_DIR` reruns ring's build script (it watches that variable), and
    // with it every crate above ring, here and again in the next build from a shell.
    for (key, _) in std::env::vars_os() {
        let key_text = key.to_string_lossy();
        if key_text.starts_with("CARGO_PKG_")
            || [
                "CARGO_MANIFEST_DIR",
                "CARGO_MANIFEST_PATH",
                "CARGO_CRATE_NAME",
                "CARGO_BIN_NAME",
                "CARGO_PRIMARY_PACKAGE",
            ]
            .contains(&key_text.as_ref())
        {
            build.env_remove(&key);
        }
    }
    if profile != "debug" {
        build.args(["--profile", &profile]);
    }
    let status = build.status().expect("cargo runs");
    assert!(
        status.success(),
        "cargo build --profile {profile} --bin iop-edge --bin iop-node failed"
    );
}

/// A loopback port for a binary to listen on, free when checked.
///
/// Ports come from below Linux's ephemeral range (32768 and up), walked by a per-process
/// counter from a start that depends on the process id. Asking the kernel for port 0
/// instead hands out ephemeral ports, which the many outgoing test connections also draw
/// from: one of them can take the port between this check and the binary's bind.
#[must_use]
pub fn free_port() -> u16 {
    const FIRST: u32 = 20_000;
    const SPAN: u32 = 12_000;
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let start = std::process::id().wrapping_mul(7_919) % SPAN;
    for _ in 0..SPAN {
        let step = u32::try_from(NEXT.fetch_add(1, Ordering::Relaxed) % u64::from(SPAN))
            .expect("below SPAN");
        let port = u16::try_from(FIRST + (start + step) % SPAN).expect("below 32000");
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port between {FIRST} and {}", FIRST + SPAN)
}

/// A temporary directory removed on drop.
#[derive(Debug)]
pub struct TempDir(PathBuf);

impl TempDir {
    /// A new empty directory.
    #[must_use]
    pub fn new(tag: &str) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!(
            "iop-{tag}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&path).expect("temp dir");
        TempDir(path)
    }

    /// The directory.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.0
    }

    /// Writes `name` with `text`, returning its path.
    pub fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, text).expect("write temp file");
        path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A child process killed on drop; its stderr goes to a log file.
#[derive(Debug)]
pub struct Proc {
    /// Locked only for a moment: to signal, reap or kill it.
    child: std::sync::Mutex<Child>,
    log: PathBuf,
    name: String,
}

impl Proc {
    /// Starts `binary` with `args`, logging to `dir/<name>.log`.
    pub fn start(
        binary_name: &str,
        args: &[&str],
        dir: &TempDir,
        name: &str,
        envs: &[(&str, &str)],
    ) -> Self {
        let log = dir.path().join(format!("{name}.log"));
        let file = std::fs::File::create(&log).expect("log file");
        let mut command = Command::new(binary(binary_name));
        command
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(file)
            // Tests read INFO lines; a benchmark may ask for less (IOP_TEST_RUST_LOG=warn).
            .env(
                "RUST_LOG",
                std::env::var("IOP_TEST_RUST_LOG").unwrap_or_else(|_| "info".to_owned()),
            );
        for (k, v) in envs {
            command.env(k, v);
        }
        let child = command.spawn().expect("spawn");
        Proc {
            child: std::sync::Mutex::new(child),
            log,
            name: name.to_owned(),
        }
    }

    /// The process id.
    #[must_use]
    pub fn pid(&self) -> u32 {
        self.child().id()
    }

    fn child(&self) -> std::sync::MutexGuard<'_, Child> {
        self.child
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Sends a signal by name (`TERM`, `KILL`, `STOP`, `CONT`, `HUP`); nothing once the
    /// process has exited and been reaped, when its pid may already be another process's
    /// (pids wrap at 32,768 on the machines the tests run on).
    pub fn signal(&self, signal: &str) {
        // Held while the signal goes: the child cannot be reaped meanwhile.
        let mut child = self.child();
        if !matches!(child.try_wait(), Ok(None)) {
            return;
        }
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(child.id().to_string())
            .status()
            .expect("kill runs");
        assert!(status.success(), "kill -{signal} {} failed", self.name);
    }

    /// Waits up to `timeout` for the process to exit.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child().try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// The exit code once the process has exited, within `timeout`; panics with its log
    /// when it has not.
    pub fn exit_code(&mut self, timeout: Duration) -> Option<i32> {
        match self.wait_exit(timeout) {
            Some(status) => status.code(),
            None => panic!(
                "{} did not exit within {timeout:?}; its log:\n{}",
                self.name,
                self.log()
            ),
        }
    }

    /// Whether it is still running.
    pub fn running(&mut self) -> bool {
        matches!(self.child().try_wait(), Ok(None))
    }

    /// The log so far.
    #[must_use]
    pub fn log(&self) -> String {
        // The binaries gather log lines for a few milliseconds before they write them
        // (`iop_shell_common::logging`): what was logged before this call is in the file
        // well within this wait.
        std::thread::sleep(std::time::Duration::from_millis(60));
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let child = self
            .child
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let _ = child.kill();
        let _ = child.wait();
        if std::thread::panicking() {
            eprintln!("----- {} log -----\n{}", self.name, self.log());
        }
    }
}

/// A TCP relay on a free loopback port that forwards to `127.0.0.1:target` and records
/// every byte in both directions: what an attacker on the path between a Node and the
/// Edge would see.
#[derive(Debug, Clone)]
pub struct Relay {
    /// Where it listens.
    pub port: u16,
    seen: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
    held: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// The other direction (what the target sends back), held only by [`Relay::cut`].
    held_back: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Relay {
    /// Starts relaying (runs on the current tokio runtime).
    pub async fn start(target: u16) -> Relay {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        // A small receive window (accepted sockets inherit it), so that a held relay
        // pushes back on its sender after little data instead of the kernel's megabytes.
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        let _ = socket.set_recv_buffer_size(16 << 10);
        socket
            .bind(std::net::SocketAddr::from(([127, 0, 0, 1], 0)))
            .expect("bind relay");
        let listener = socket.listen(64).expect("listen");
        let port = listener.local_addr().expect("addr").port();
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let recorded = seen.clone();
        let held = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let holding = held.clone();
        let held_back = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let holding_back = held_back.clone();
        tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let Ok(outbound) = tokio::net::TcpStream::connect(("127.0.0.1", target)).await
                else {
                    continue;
                };
                let (ir, iw) = inbound.into_split();
                let (or, ow) = outbound.into_split();
                for (mut from, mut to, seen, hold) in [
                    (
                        Box::new(ir) as Box<dyn tokio::io::AsyncRead + Unpin + Send>,
                        Box::new(ow) as Box<dyn tokio::io::AsyncWrite + Unpin + Send>,
                        recorded.clone(),
                        holding.clone(),
                    ),
                    (
                        Box::new(or),
                        Box::new(iw),
                        recorded.clone(),
                        holding_back.clone(),
                    ),
                ] {
                    tokio::spawn(async move {
                        let mut buf = vec![0u8; 16 << 10];
                        let held = || async {
                            while hold.load(std::sync::atomic::Ordering::Acquire) {
                                tokio::time::sleep(Duration::from_millis(5)).await;
                            }
                        };
                        loop {
                            held().await;
                            match from.read(&mut buf).await {
                                Ok(0) | Err(_) => break,
                                Ok(n) => {
                                    // What a read already under way returns once held
                                    // waits too.
                                    held().await;
                                    if let Ok(mut seen) = seen.lock() {
                                        seen.extend_from_slice(&buf[..n]);
                                    }
                                    if to.write_all(&buf[..n]).await.is_err() {
                                        break;
                                    }
                                }
                            }
                        }
                        let _ = to.shutdown().await;
                    });
                }
            }
        });
        Relay {
            port,
            seen,
            held,
            held_back,
        }
    }

    /// Stops (`true`) or resumes reading what the connecting side (a Node) sends, as an
    /// Edge that does not read, or a stalled network path, would.
    pub fn hold(&self, held: bool) {
        self.held.store(held, std::sync::atomic::Ordering::Release);
    }

    /// Stops (`true`) or resumes relaying in both directions, as a network partition
    /// would: neither side hears the other, though no connection closes.
    pub fn cut(&self, cut: bool) {
        self.held_back
            .store(cut, std::sync::atomic::Ordering::Release);
        self.hold(cut);
    }

    /// Every byte relayed so far, both directions interleaved.
    #[must_use]
    pub fn seen(&self) -> Vec<u8> {
        self.seen.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Whether `needle` crossed the relay in clear.
    #[must_use]
    pub fn saw(&self, needle: &str) -> bool {
        let seen = self.seen();
        seen.windows(needle.len()).any(|w| w == needle.as_bytes())
    }
}

/// Polls `check` every 20 ms until it returns true or `timeout` passes.
pub fn wait_until(timeout: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if check() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}
