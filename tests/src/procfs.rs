//! What the harnesses read about a process from `/proc`: resident memory and CPU time,
//! of one process or of it and its children (nginx's workers).

use std::time::Duration;

/// The fields of `/proc/<pid>/stat` after the command name (which may hold spaces);
/// empty when the process is gone.
fn stat_fields(pid: u32) -> Vec<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    stat.rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().map(str::to_owned).collect())
        .unwrap_or_default()
}

/// The processes whose parent is `pid`.
#[must_use]
pub fn children(pid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&child| stat_fields(child).get(1).and_then(|p| p.parse().ok()) == Some(pid))
        .collect()
}

/// The scheduling policy of a process's main thread (`stat` field 41: 0 the default,
/// 3 `SCHED_BATCH`); `None` when it is gone.
#[must_use]
pub fn policy(pid: u32) -> Option<u32> {
    stat_fields(pid).get(41 - 3)?.parse().ok()
}

/// The CPU a process's main thread last ran on (`stat` field 39); `None` when it is gone.
#[must_use]
pub fn last_cpu(pid: u32) -> Option<usize> {
    stat_fields(pid).get(39 - 3)?.parse().ok()
}

/// Resident memory of a process, in KiB (0 when it is gone).
#[must_use]
pub fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// User + system CPU time a process has used so far.
#[must_use]
pub fn cpu(pid: u32) -> Duration {
    let fields = stat_fields(pid);
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    // utime and stime: fields 14 and 15 of stat, 11 and 12 after the name; 100 ticks/s.
    Duration::from_millis((ticks(11) + ticks(12)) * 10)
}

/// The `cpu` line of `/proc/stat`: user, nice, system, idle, iowait, irq, softirq and
/// steal ticks so far (guest time is inside user); zeros where it cannot be read.
fn cpu_ticks() -> [u64; 8] {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let mut ticks = [0u64; 8];
    let fields = stat.lines().next().unwrap_or_default().split_whitespace();
    for (slot, field) in ticks.iter_mut().zip(fields.skip(1)) {
        *slot = field.parse().unwrap_or(0);
    }
    ticks
}

/// The whole machine's busy and total CPU ticks so far. Idle and I/O wait are not busy;
/// steal is.
#[must_use]
pub fn machine_ticks() -> (u64, u64) {
    let ticks = cpu_ticks();
    let all: u64 = ticks.iter().sum();
    (all.saturating_sub(ticks[3] + ticks[4]), all)
}

/// The whole machine's CPU ticks the hypervisor took for other guests (steal) and all
/// ticks so far. On a shared virtual machine a run during which steal was high says more
/// about the host than about the code measured.
#[must_use]
pub fn machine_steal_ticks() -> (u64, u64) {
    let ticks = cpu_ticks();
    (ticks[7], ticks.iter().sum())
}

/// [`rss_kib`] of a process and its children.
#[must_use]
pub fn tree_rss_kib(pid: u32) -> u64 {
    rss_kib(pid) + children(pid).into_iter().map(rss_kib).sum::<u64>()
}

/// [`cpu`] of a process and its children.
#[must_use]
pub fn tree_cpu(pid: u32) -> Duration {
    cpu(pid) + children(pid).into_iter().map(cpu).sum::<Duration>()
}

#[cfg(test)]
mod tests {
    #[test]
    fn machine_ticks_are_parts_of_a_growing_whole() {
        let (busy, all) = super::machine_ticks();
        let (stolen, all_again) = super::machine_steal_ticks();
        assert!(all > 0, "/proc/stat has a cpu line");
        assert!(busy <= all && stolen <= all_again);
        assert!(all_again >= all, "ticks only grow");
    }
}
