//! The figures a run reports: medians, shares, the table rows and where they are written.

#[allow(unused_imports)]
use crate::*;
use iop_blackbox::fleet::{self, count};

pub(crate) fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

/// The median of each figure over the rounds.
pub(crate) fn med(runs: &[Run]) -> Run {
    Run {
        rps: median(runs.iter().map(|r| r.rps).collect()),
        p50_us: median(runs.iter().map(|r| r.p50_us).collect()),
        p99_us: median(runs.iter().map(|r| r.p99_us).collect()),
        errors: runs.iter().map(|r| r.errors).sum(),
        cpu_us: median(runs.iter().map(|r| r.cpu_us).collect()),
        stolen: runs
            .iter()
            .fold((0, 0), |(s, a), r| (s + r.stolen.0, a + r.stolen.1)),
        together: runs
            .iter()
            .fold((0, 0), |(s, a), r| (s + r.together.0, a + r.together.1)),
    }
}

/// The share of the machine's CPU time the hypervisor stole over `runs`.
pub(crate) fn stolen_share(runs: &[&Run]) -> f64 {
    let (stolen, all) = runs
        .iter()
        .fold((0u64, 0u64), |(s, a), r| (s + r.stolen.0, a + r.stolen.1));
    stolen as f64 / f64::max(all as f64, 1.0)
}

pub(crate) fn iop_body(provider: u16) -> String {
    format!(
        r#"
[[nodes]]
id = "n1"
token = "bench-node-token-0123456789"
[[nodes.adapters]]
name = "oa"
type = "openai_compat"
base_url = "http://127.0.0.1:{provider}"
capacity = 4096
targets = ["fake"]

[[models]]
name = "fake"
providers = [{{ node = "n1", adapter = "oa", target = "fake" }}]
"#
    )
}

/// The fleet's two rows of the table, each link's figure in its own IOP column (TLS, then
/// plaintext): the Edge's memory per idle connected node, and the time until every node
/// is ready again after the Edge restarts, with the bare references (TCP connects, then
/// bare clients redialling over TLS / plaintext) in the direct column and the restart
/// over the bare reconnects of the same link in IOP's (`iop_blackbox::fleet`).
pub(crate) fn fleet_rows(rows: &[fleet::Row], trailing: usize) -> String {
    let cells = |cell: &dyn Fn(&fleet::Row) -> String| {
        rows.iter().map(cell).collect::<Vec<_>>().join(" | ")
    };
    let links = rows
        .iter()
        .map(|r| r.link_name())
        .collect::<Vec<_>>()
        .join(" / ");
    let nodes = count(rows.first().map_or(0, |r| r.nodes));
    format!(
        "| Edge memory per idle connected node, {nodes} nodes | – | – | {} |\n\
         | {nodes} nodes ready again after an Edge restart, median of {} (direct: bare TCP connects; then bare clients redialling by the same policy, {links}) | {:.3} s; {} | – | {} |",
        cells(&|r| format!("{:.1} KiB", r.per_node_kib)),
        fleet::RESTARTS,
        rows.first().map_or(0.0, |r| r.raw.as_secs_f64()),
        rows.iter()
            .map(|r| format!("{:.3} s", r.bare_again().as_secs_f64()))
            .collect::<Vec<_>>()
            .join(" / "),
        cells(&|r| {
            format!(
                "{} ({})",
                fleet::seconds(r.again),
                r.restart_ratio()
                    .map_or_else(|| "–".to_owned(), |x| format!("{x:.2}×"))
            )
        }),
    )
    .lines()
    .map(|line| format!("{line}{}", " – |".repeat(trailing)))
    .collect::<Vec<_>>()
    .join("\n")
}

/// Where `--write` puts the table: between these lines of the file, replacing what was
/// there (the file's other sections are the record of earlier runs and are left alone).
pub(crate) const LATEST_BEGIN: &str =
    "<!-- bench:latest (written by `bench --write`; replaced on every run) -->";
pub(crate) const LATEST_END: &str = "<!-- /bench:latest -->";

/// Puts `report` between the latest-run markers of `path`, or appends a block with them.
pub(crate) fn write_report(path: &std::path::Path, report: &str) -> std::io::Result<()> {
    // A file that is not there gets the block; one that cannot be read is left alone.
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(err) => return Err(err),
    };
    let block = format!("{LATEST_BEGIN}\n**Latest run of the harness.** {report}{LATEST_END}");
    let updated = match (text.find(LATEST_BEGIN), text.find(LATEST_END)) {
        (Some(begin), Some(end)) if begin < end => format!(
            "{}{block}{}",
            &text[..begin],
            &text[end + LATEST_END.len()..]
        ),
        _ => format!("{text}\n{block}\n"),
    };
    std::fs::write(path, updated)
}
