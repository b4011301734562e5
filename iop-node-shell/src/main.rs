//! `iop-node`: runs beside LLM providers and dials out to the Edge.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use iop_node_shell::config::{NodeConfig, Scheduler};
use iop_node_shell::supervisor;
use iop_shell_common::logging::{self, LogFormat};
use iop_shell_common::process;

/// jemalloc, whose background thread returns freed memory to the system within seconds;
/// glibc's malloc kept tens of MiB after a burst of large request bodies (BENCHMARKS.md).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// IOP Node: connects LLM providers to an IOP Edge.
#[derive(Debug, Parser)]
#[command(name = "iop-node", version, about)]
struct Cli {
    /// The node's TOML config file.
    #[arg(long, global = true, default_value = "node.toml")]
    config: PathBuf,
    /// Log format on stderr.
    #[arg(long, global = true, value_enum, default_value = "text")]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Connect to the Edge and serve (the default).
    Run,
    /// Validate the config file and exit (0 valid, 1 invalid).
    CheckConfig,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let _log = logging::init(cli.log_format);
    let config = match NodeConfig::load(&cli.config) {
        Ok(config) => config,
        Err(err) => return process::invalid_config("iop-node", &cli.config, &err),
    };
    if matches!(cli.command, Some(Command::CheckConfig)) {
        let link = match &config.link {
            iop_node_shell::config::LinkConfig::Plain => "PLAINTEXT".to_owned(),
            iop_node_shell::config::LinkConfig::Tls {
                trust, client_cert, ..
            } => format!(
                "TLS, edge checked by {}{}",
                match trust {
                    iop_node_shell::config::EdgeTrust::Pinned(_) => "pinned fingerprint",
                    iop_node_shell::config::EdgeTrust::Roots(_) => "CA",
                },
                if client_cert.is_some() {
                    ", client certificate"
                } else {
                    ""
                }
            ),
        };
        println!(
            "{}: ok (node_id {}, edge {}, {link})",
            cli.config.display(),
            config.node_id,
            config.edge_addr
        );
        return ExitCode::SUCCESS;
    }
    // Before the runtime: the threads it starts inherit the policy.
    if config.scheduler == Scheduler::Batch {
        match process::batch_scheduling() {
            Ok(true) => tracing::info!(scheduler = "batch", "scheduling policy set"),
            Ok(false) => tracing::info!(
                requested = "batch",
                "kept the scheduling policy the node was started with"
            ),
            Err(err) => tracing::warn!(
                error = %err,
                "SCHED_BATCH refused: the node runs under the policy it was started with"
            ),
        }
    }
    // Under `SCHED_BATCH` the Node already defers to the process it shares a CPU with;
    // told to keep its policy, it neither defers nor yields.
    let before_park = if config.scheduler == Scheduler::Batch {
        process::BeforePark::YieldMidResponse
    } else {
        process::BeforePark::Wait
    };
    let runtime = match process::runtime("iop-node", process::Threads::One, before_park) {
        Ok(runtime) => runtime,
        Err(code) => return code,
    };
    let reason = runtime.block_on(async move {
        let ctx = supervisor::context(&config)
            .map_err(|err| process::invalid_config("iop-node", &cli.config, &err))?;
        let stop = supervisor::Stop::default();
        tokio::spawn(process::cancel_on_signal(stop.now.clone()));
        tokio::spawn(process::cancel_on_quit(stop.drain.clone()));
        tokio::spawn(process::ignore_hangup(
            "a Node's adapters come from the Edge (send the Edge SIGHUP); its own file is read at start only",
        ));
        Ok(supervisor::run(config, ctx, stop).await)
    });
    match reason {
        Ok(reason) => ExitCode::from(u8::try_from(reason.exit_code()).unwrap_or(1)),
        Err(code) => code,
    }
}
