//! `iop-edge`: the public OpenAI-compatible entry point of IOP.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use iop_edge_shell::config::Config;
use iop_shell_common::logging::{self, LogFormat};
use iop_shell_common::process;

/// jemalloc, whose background thread returns freed memory to the system within seconds;
/// glibc's malloc kept tens of MiB after a burst of large request bodies (BENCHMARKS.md).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// IOP Edge: serves the OpenAI-compatible HTTP API and dispatches work to Nodes.
#[derive(Debug, Parser)]
#[command(name = "iop-edge", version, about)]
struct Cli {
    /// The edge's TOML config file.
    #[arg(long, global = true, default_value = "edge.toml")]
    config: PathBuf,
    /// Log format on stderr.
    #[arg(long, global = true, value_enum, default_value = "text")]
    log_format: LogFormat,
    /// Take the listeners over from the Edge running with the same upgrade socket
    /// (`listen.upgrade_socket`) instead of binding them: an upgrade or restart that
    /// drops no request. Without a running Edge it starts as usual.
    #[arg(long, global = true)]
    takeover: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve (the default).
    Run,
    /// Validate the config file and exit (0 valid, 1 invalid).
    CheckConfig,
    /// Write a certificate and key for the node link (self-signed by default) and print
    /// the certificate's SHA-256 fingerprint, which Nodes can pin.
    GenCert {
        /// A DNS name or IP address the certificate is for (repeat for more; the first
        /// is also the subject name). For a Node's client certificate, its node id.
        #[arg(long = "name", required = true)]
        names: Vec<String>,
        /// Certificate output file (PEM).
        #[arg(long, default_value = "edge-cert.pem")]
        cert: PathBuf,
        /// Private key output file (PEM, written with mode 0600).
        #[arg(long, default_value = "edge-key.pem")]
        key: PathBuf,
        /// Validity in days.
        #[arg(long, default_value_t = 825)]
        days: u32,
        /// Make a certificate authority (to issue Edge and Node certificates from).
        #[arg(long)]
        ca: bool,
        /// Issue with this CA certificate instead of self-signing (needs --ca-key).
        #[arg(long, requires = "ca_key")]
        ca_cert: Option<PathBuf>,
        /// The CA's private key.
        #[arg(long, requires = "ca_cert")]
        ca_key: Option<PathBuf>,
        /// Replace existing files.
        #[arg(long)]
        force: bool,
    },
    /// The configuration several Edges share through etcd (`[cluster]` in --config).
    Config {
        #[command(subcommand)]
        action: ConfigAction,
    },
}

#[derive(Debug, Subcommand)]
enum ConfigAction {
    /// Check a file's shared sections (nodes, models, auth, routing, queue, admission,
    /// heartbeat, timeouts) with this edge's own file, write them to etcd for every Edge
    /// of the cluster, and wait for each member's answer. Exits 0 when every member
    /// applied it, 1 when it was refused before writing, 2 when a member refused it or
    /// did not answer in time.
    Push {
        /// The TOML file to push.
        file: PathBuf,
        /// Show the difference from what etcd holds first.
        #[arg(long)]
        diff: bool,
        /// Only show the difference; push nothing.
        #[arg(long)]
        dry_run: bool,
        /// Seconds to wait for every member's answer.
        #[arg(long, default_value_t = 10)]
        wait_sec: u64,
    },
}

fn gen_cert(request: iop_edge_shell::certgen::Request) -> ExitCode {
    match iop_edge_shell::certgen::generate(&request) {
        Ok(made) => {
            println!("certificate: {}", request.cert.display());
            println!("private key: {}", request.key.display());
            println!("SHA-256 fingerprint: {}", made.fingerprint);
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("iop-edge gen-cert: {err}");
            ExitCode::from(1)
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let _log = logging::init(cli.log_format);
    if let Some(Command::GenCert {
        names,
        cert,
        key,
        days,
        ca,
        ca_cert,
        ca_key,
        force,
    }) = cli.command
    {
        return gen_cert(iop_edge_shell::certgen::Request {
            names,
            cert,
            key,
            days,
            ca,
            issuer: ca_cert.zip(ca_key),
            force,
        });
    }
    let config = match Config::load(&cli.config) {
        Ok(config) => config,
        Err(err) => return process::invalid_config("iop-edge", &cli.config, &err),
    };
    if let Some(Command::Config {
        action:
            ConfigAction::Push {
                file,
                diff,
                dry_run,
                wait_sec,
            },
    }) = &cli.command
    {
        let Some(settings) = config.cluster.clone() else {
            eprintln!(
                "iop-edge config push: {} has no [cluster] section naming etcd",
                cli.config.display()
            );
            return ExitCode::from(1);
        };
        let push = iop_edge_shell::cluster::Push {
            local: cli.config.clone(),
            file: file.clone(),
            diff: *diff,
            dry_run: *dry_run,
            wait: std::time::Duration::from_secs(*wait_sec),
        };
        let runtime = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(runtime) => runtime,
            Err(err) => {
                eprintln!("iop-edge config push: {err}");
                return ExitCode::from(1);
            }
        };
        return ExitCode::from(runtime.block_on(iop_edge_shell::cluster::push(&settings, &push)));
    }
    if matches!(cli.command, Some(Command::CheckConfig)) {
        let cluster = config.cluster.as_ref().map_or(String::new(), |c| {
            format!(
                "; cluster member {} through {} etcd endpoint(s), prefix {}",
                c.edge_id,
                c.endpoints.len(),
                c.prefix
            )
        });
        println!(
            "{}: ok ({} nodes, {} models; node link {}{cluster})",
            cli.config.display(),
            config.core.nodes.len(),
            config.core.models.len(),
            match (
                &config.tls.nodes,
                config.core.admission.require_client_identity
            ) {
                (None, _) => "PLAINTEXT",
                (Some(_), false) => "TLS",
                (Some(_), true) => "mutual TLS",
            }
        );
        return ExitCode::SUCCESS;
    }
    let runtime = match process::runtime(
        "iop-edge",
        process::Threads::Workers(config.worker_threads),
        process::BeforePark::Wait,
    ) {
        Ok(runtime) => runtime,
        Err(code) => return code,
    };
    let result = runtime.block_on(async move {
        let stop = iop_edge_shell::Stop::default();
        tokio::spawn(process::cancel_on_signals(vec![
            (stop.drain.clone(), "shutdown requested"),
            (stop.now.clone(), "stop requested at once"),
        ]));
        iop_edge_shell::run(config, cli.config, stop, true, cli.takeover).await
    });
    // Work on the blocking pool is not waited for past a moment: a reload stuck reading
    // a file that never ends (a FIFO nobody writes) must not keep the Edge from exiting.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            logging::flush();
            eprintln!("iop-edge: {err}");
            ExitCode::from(1)
        }
    }
}
