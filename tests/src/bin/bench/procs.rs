//! The processes a run starts (nginx, rathole, IOP) and where they run: CPU placement and the tools.

#[allow(unused_imports)]
use crate::*;
use iop_blackbox::procfs::{children, tree_cpu as cpu, tree_rss_kib as rss_kib};
use iop_blackbox::{TempDir, free_port};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

// ----- processes and measurement -----

/// A path under test: where its clients connect, and the processes that make it up.
pub(crate) struct Path3 {
    pub(crate) name: &'static str,
    pub(crate) port: u16,
    pub(crate) pids: Vec<u32>,
    /// Two single-threaded processes whose CPUs are sampled during every wrk run
    /// (`Together`): IOP's Edge and Node, when the Edge polls on its main thread alone.
    pub(crate) pair: Option<(u32, u32)>,
}

impl Path3 {
    pub(crate) fn cpu(&self) -> Duration {
        self.cpus().into_iter().sum()
    }

    pub(crate) fn cpus(&self) -> Vec<Duration> {
        self.pids.iter().map(|p| cpu(*p)).collect()
    }

    pub(crate) fn rss(&self) -> Vec<u64> {
        self.pids.iter().map(|p| rss_kib(*p)).collect()
    }
}

/// The cells of a proxy CPU row from a figure per path (direct, nginx, then IOP's): "–"
/// for direct, nginx's figure, and each of IOP's with it as a multiple of nginx's, each
/// figure with `decimals` decimals.
pub(crate) fn cpu_cells(per_path_us: &[f64], decimals: usize) -> Vec<String> {
    let nginx = per_path_us.get(1).copied().unwrap_or(0.0);
    per_path_us
        .iter()
        .enumerate()
        .map(|(i, us)| match i {
            0 => "–".to_owned(),
            1 => format!("{us:.decimals$} µs"),
            _ => format!("{us:.decimals$} µs ({:.2}× nginx)", us / nginx),
        })
        .collect()
}

/// Binds every thread of `pid` to `cpus` (a `taskset` list: "1", "0-1").
pub(crate) fn taskset(pid: u32, cpus: &str) -> bool {
    Command::new("taskset")
        .args(["-a", "-p", "-c", cpus, &pid.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The CPUs this process may run on (`Cpus_allowed_list` of `/proc/self/status`, such as
/// "0-3,6"), in order; empty when it cannot be read.
pub(crate) fn allowed_cpus() -> Vec<usize> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .map_or_else(Vec::new, cpu_list)
}

/// The CPUs of a kernel CPU list ("0-3,6"), in order; empty for a malformed one.
pub(crate) fn cpu_list(list: &str) -> Vec<usize> {
    let mut cpus = Vec::new();
    for part in list.trim().split(',') {
        let (first, last) = part.split_once('-').unwrap_or((part, part));
        match (first.trim().parse::<usize>(), last.trim().parse::<usize>()) {
            (Ok(first), Ok(last)) if first <= last && last < 4096 => cpus.extend(first..=last),
            _ => return Vec::new(),
        }
    }
    cpus
}

/// Pins a path's event loops to CPUs of `cpus` (at least two), or lets them run on all of
/// `cpus` again. Pinned, each single-threaded process of the path gets a CPU of its own
/// (the Edge the first, the Node the second), and each nginx hop's workers are spread
/// over the CPUs as `worker_cpu_affinity auto` places them. The load generator and the
/// provider are never pinned. False when `taskset` failed.
pub(crate) fn place(path: &Path3, pinned: bool, cpus: &[usize]) -> bool {
    let anywhere = cpus
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let at = |i: usize| {
        if pinned {
            cpus[i % cpus.len()].to_string()
        } else {
            anywhere.clone()
        }
    };
    let mut placed = true;
    for (i, &pid) in path.pids.iter().enumerate() {
        let mut workers = children(pid);
        if workers.is_empty() {
            placed &= taskset(pid, &at(i));
        } else {
            workers.sort_unstable();
            for (j, worker) in workers.into_iter().enumerate() {
                placed &= taskset(worker, &at(j));
            }
        }
    }
    placed
}

pub(crate) fn ensure_tools() {
    let missing: Vec<&str> = ["nginx", "wrk"]
        .into_iter()
        .filter(|tool| which(tool).is_none())
        .collect();
    if missing.is_empty() {
        return;
    }
    if std::env::var_os("IOP_BENCH_NO_INSTALL").is_some() {
        panic!("missing {missing:?}: install nginx and wrk");
    }
    eprintln!("bench: installing {missing:?} with apt-get");
    let _ = Command::new("apt-get").arg("update").status();
    let status = Command::new("apt-get")
        .args([
            "install",
            "-y",
            "--no-install-recommends",
            "nginx-light",
            "wrk",
        ])
        .status()
        .expect("apt-get runs");
    assert!(status.success(), "apt-get install nginx-light wrk failed");
    // The package starts a system nginx on port 80; this harness runs its own.
    let _ = Command::new("nginx").args(["-s", "stop"]).status();
}

pub(crate) fn which(tool: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
        .map(|dir| dir.join(tool))
        .find(|p| p.exists())
}

/// One nginx instance listening on `port` and proxying everything to `upstream`.
pub(crate) fn start_nginx(dir: &TempDir, name: &str, port: u16, upstream: u16) -> Child {
    let root = dir.path().join(name);
    std::fs::create_dir_all(&root).expect("nginx dir");
    let r = root.display();
    let conf = format!(
        r#"worker_processes auto;
daemon off;
pid {r}/nginx.pid;
error_log {r}/error.log warn;
worker_rlimit_nofile 20000;
events {{ worker_connections 10000; }}
http {{
  access_log {r}/access.log combined buffer=64k flush=1s;
  client_body_temp_path {r}/body;
  proxy_temp_path {r}/proxy;
  fastcgi_temp_path {r}/fastcgi;
  uwsgi_temp_path {r}/uwsgi;
  scgi_temp_path {r}/scgi;
  keepalive_requests 1000000;
  upstream next {{ server 127.0.0.1:{upstream}; keepalive 512; keepalive_requests 1000000; }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    client_max_body_size 16m;
    location / {{
      proxy_pass http://next;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
    }}
  }}
}}
"#
    );
    let file = root.join("nginx.conf");
    std::fs::write(&file, conf).expect("nginx.conf");
    Command::new(which("nginx").expect("nginx"))
        .arg("-p")
        .arg(&root)
        .arg("-c")
        .arg(&file)
        .arg("-e")
        .arg(root.join("error.log"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("nginx starts")
}

/// rathole's binary: on the PATH, built earlier into `target/bench-tools`, or installed
/// there now with cargo (plain TCP transport only; a few minutes, once) unless
/// `IOP_BENCH_NO_INSTALL` forbids it. `None` leaves rathole out of the run.
pub(crate) fn rathole_binary() -> Option<PathBuf> {
    if let Some(path) = which("rathole") {
        return Some(path);
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/bench-tools");
    let bin = root.join("bin/rathole");
    if bin.exists() {
        return Some(bin);
    }
    if std::env::var_os("IOP_BENCH_NO_INSTALL").is_some() {
        eprintln!("bench: rathole not found and IOP_BENCH_NO_INSTALL is set: no rathole column");
        return None;
    }
    eprintln!(
        "bench: installing rathole with cargo into {}",
        root.display()
    );
    let installed = Command::new("cargo")
        .args(["install", "rathole", "--version", "0.5.0"])
        .args([
            "--no-default-features",
            "--features",
            "server,client",
            "--root",
        ])
        .arg(&root)
        .env("CARGO_TARGET_DIR", root.join("build"))
        .status()
        .is_ok_and(|s| s.success());
    if installed && bin.exists() {
        Some(bin)
    } else {
        eprintln!("bench: rathole did not install: no rathole column");
        None
    }
}

/// rathole between `port` and the provider: its server (the public side, where callers
/// connect) and its client (beside the provider, dialling out to the server, as IOP's Node
/// does), plain TCP. One hop that forwards bytes without reading them: the next mark
/// issue 56 set.
pub(crate) fn start_rathole(bin: &Path, dir: &TempDir, port: u16, provider: u16) -> (Child, Child) {
    let control = free_port();
    let root = dir.path().join("rathole");
    std::fs::create_dir_all(&root).expect("rathole dir");
    let token = "iop-bench-rathole-token";
    let server = root.join("server.toml");
    std::fs::write(
        &server,
        format!(
            "[server]\nbind_addr = \"127.0.0.1:{control}\"\n[server.transport]\ntype = \"tcp\"\n[server.transport.tcp]\nnodelay = true\n[server.services.p]\ntoken = \"{token}\"\nbind_addr = \"127.0.0.1:{port}\"\nnodelay = true\n"
        ),
    )
    .expect("rathole server.toml");
    let client = root.join("client.toml");
    std::fs::write(
        &client,
        format!(
            "[client]\nremote_addr = \"127.0.0.1:{control}\"\n[client.transport]\ntype = \"tcp\"\n[client.transport.tcp]\nnodelay = true\n[client.services.p]\ntoken = \"{token}\"\nlocal_addr = \"127.0.0.1:{provider}\"\nnodelay = true\n"
        ),
    )
    .expect("rathole client.toml");
    let start = |flag: &str, config: &Path| {
        Command::new(bin)
            .arg(flag)
            .arg(config)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("rathole starts")
    };
    let server = start("-s", &server);
    wait_port(control);
    let client = start("-c", &client);
    wait_port(port);
    // The client registers its service over the control channel after connecting.
    std::thread::sleep(Duration::from_millis(500));
    (server, client)
}

pub(crate) fn wait_port(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("nothing listens on {port}");
}
