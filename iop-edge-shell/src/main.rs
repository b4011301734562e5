//! `iop-edge`: the public OpenAI-compatible entry point of IOP.

use clap::Parser;

/// IOP Edge: serves the OpenAI-compatible HTTP API and dispatches work to Nodes.
#[derive(Debug, Parser)]
#[command(name = "iop-edge", version, about)]
struct Cli {}

fn main() {
    let _cli = Cli::parse();
    eprintln!("iop-edge: serving is not implemented yet (see issue 7)");
    std::process::exit(2);
}
