//! `iop-node`: runs beside LLM providers and dials out to the Edge.

use clap::Parser;

/// IOP Node: connects LLM providers to an IOP Edge.
#[derive(Debug, Parser)]
#[command(name = "iop-node", version, about)]
struct Cli {}

fn main() {
    let _cli = Cli::parse();
    eprintln!("iop-node: running is not implemented yet (see issue 6)");
    std::process::exit(2);
}
