//! `iop-edge`: the public OpenAI-compatible entry point of IOP.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use iop_edge_shell::config::Config;
use iop_edge_shell::logging::{self, LogFormat};
use tokio_util::sync::CancellationToken;

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
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve (the default).
    Run,
    /// Validate the config file and exit (0 valid, 1 invalid).
    CheckConfig,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    logging::init(cli.log_format);
    let config = match Config::load(&cli.config) {
        Ok(config) => config,
        Err(err) => {
            tracing::error!(config = %cli.config.display(), error = %err, "invalid configuration");
            eprintln!("iop-edge: {err}");
            return ExitCode::from(1);
        }
    };
    if matches!(cli.command, Some(Command::CheckConfig)) {
        println!(
            "{}: ok ({} nodes, {} models)",
            cli.config.display(),
            config.core.nodes.len(),
            config.core.models.len()
        );
        return ExitCode::SUCCESS;
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("iop-edge: cannot start the runtime: {err}");
            return ExitCode::from(1);
        }
    };
    let result = runtime.block_on(async move {
        let shutdown = CancellationToken::new();
        tokio::spawn(wait_for_signal(shutdown.clone()));
        iop_edge_shell::run(config, cli.config, shutdown, true).await
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("iop-edge: {err}");
            ExitCode::from(1)
        }
    }
}

async fn wait_for_signal(shutdown: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!(signal = "SIGTERM", "shutdown requested"),
        _ = int.recv() => tracing::info!(signal = "SIGINT", "shutdown requested"),
    }
    shutdown.cancel();
}
