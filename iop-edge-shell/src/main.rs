//! `iop-edge`: the public OpenAI-compatible entry point of IOP.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use iop_edge_shell::config::Config;
use iop_shell_common::logging::{self, LogFormat};
use iop_shell_common::process;
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
        Err(err) => return process::invalid_config("iop-edge", &cli.config, &err),
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
    let runtime = match process::runtime("iop-edge") {
        Ok(runtime) => runtime,
        Err(code) => return code,
    };
    let result = runtime.block_on(async move {
        let shutdown = CancellationToken::new();
        tokio::spawn(process::cancel_on_signal(shutdown.clone()));
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
