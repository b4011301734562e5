//! Process plumbing shared by the binaries: the tokio runtime and shutdown signals.

use std::process::ExitCode;

use tokio_util::sync::CancellationToken;

/// How many threads a binary's runtime polls its tasks on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Threads {
    /// This many workers of tokio's multi-threaded scheduler; one is the same as
    /// [`Threads::One`]. The Edge: its protocol work runs under one lock, so workers
    /// beyond that parallelise HTTP, JSON and TLS, and every one more adds wake-ups
    /// across threads.
    Workers(std::num::NonZeroUsize),
    /// Only the thread that starts the runtime: the Node. Its work is moving bytes
    /// between one Edge link and its providers, which one core does faster than two
    /// that keep waking each other (a frame from the Edge, the adapter task it starts
    /// and the frames it sends back all stay on one thread).
    One,
}

/// What a runtime thread does when it runs out of tasks, before it waits for its sockets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BeforePark {
    /// Nothing: it waits at once (the Edge, and a Node told to keep its scheduling
    /// policy, which then must not hand its CPU to others either). What tasks note with
    /// [`note_response_pending`] is then left unread: one flag per thread, overwritten.
    Wait,
    /// If a task noted a response still arriving ([`note_response_pending`]), it first
    /// lets what else is runnable on its CPU go, once: the Node under `SCHED_BATCH`.
    YieldMidResponse,
}

/// The runtime a binary runs on; on failure the message is printed under `program`'s
/// name and the exit code to return is given back.
pub fn runtime(
    program: &str,
    threads: Threads,
    before_park: BeforePark,
) -> Result<tokio::runtime::Runtime, ExitCode> {
    let mut builder = match threads {
        Threads::Workers(n) if n.get() > 1 => {
            let mut builder = tokio::runtime::Builder::new_multi_thread();
            builder.worker_threads(n.get());
            builder
        }
        Threads::Workers(_) | Threads::One => tokio::runtime::Builder::new_current_thread(),
    };
    builder.event_interval(EVENT_INTERVAL);
    if before_park == BeforePark::YieldMidResponse {
        builder.on_thread_park(yield_if_response_pending);
    }
    builder.enable_all().build().map_err(|err| {
        eprintln!("{program}: cannot start the runtime: {err}");
        ExitCode::from(1)
    })
}

/// Tasks a runtime thread polls between two looks at its sockets (tokio's default is
/// 61). A proxy's tasks are short, and a socket that became ready while a burst of them
/// ran is work for the next process of the path (the Node's provider, the Edge's
/// caller): seen after 8 tasks instead of 61, it goes on while this process is still
/// busy, instead of after it, and less of the machine sits idle between the hops; the
/// extra looks are `epoll_wait` calls that return at once. 1 was worse than the default
/// (the figures, against 61 and 1: docs/benchmarks-history.md).
const EVENT_INTERVAL: u32 = 8;

thread_local! {
    /// Whether a task on this thread found an upstream response with more to come and
    /// nothing to read yet, since the thread last went to wait for its sockets.
    static MID_RESPONSE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Tells the runtime of the calling thread that a task waits for the rest of an upstream
/// response (the Node's provider body, mid-stream). When the thread next runs out of
/// tasks, before it waits for its sockets, a runtime built with
/// [`BeforePark::YieldMidResponse`] then lets whatever else is runnable on its CPU go
/// first (`sched_yield`), once: the hop downstream forwards what it was just sent
/// and the provider writes more, so the next read takes several events instead of one.
/// On a CPU with nothing else to run the yield returns at once, and nothing waits for a
/// timer. Yielding at every park, not only mid-response, cost small requests more than
/// it gave streams (the figures: docs/benchmarks-history.md).
pub fn note_response_pending() {
    MID_RESPONSE.with(|pending| pending.set(true));
}

/// Whether [`note_response_pending`] was called on this thread since the last time this
/// was asked (the runtime asks before each wait for its sockets).
#[must_use]
pub fn take_response_pending() -> bool {
    MID_RESPONSE.with(|pending| pending.replace(false))
}

/// The runtime's hook before a thread waits for its sockets, with
/// [`BeforePark::YieldMidResponse`]: see [`note_response_pending`].
fn yield_if_response_pending() {
    if take_response_pending() {
        std::thread::yield_now();
    }
}

/// The default number of worker threads of a runtime that may use several: half the
/// CPUs this process may run on, at least one. Workers wake each other to share the
/// tasks one node link feeds, so on a small machine a second one costs CPU per request
/// and adds no throughput (docs/benchmarks-history.md); half leaves the rest of a
/// machine to the kernel's network work and to what shares it.
#[must_use]
pub fn default_workers() -> std::num::NonZeroUsize {
    let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    std::num::NonZeroUsize::new(cpus / 2).unwrap_or(std::num::NonZeroUsize::MIN)
}

/// Puts the calling thread under Linux's `SCHED_BATCH` policy, and with it every thread
/// it starts afterwards (call it before the runtime starts any), if it runs under the
/// default policy; `Ok(true)` if it did. A process started under another policy (`chrt`,
/// systemd's `CPUSchedulingPolicy=`) keeps it, as its operator chose: `Ok(false)`, as on
/// systems other than Linux.
///
/// `SCHED_BATCH` gives a thread the same share of the CPU as the default policy and the
/// same niceness; what it changes is that a batch thread that wakes does not preempt the
/// thread running on its CPU, but waits until that one blocks or uses up its slice
/// (sched(7): "workloads that want a deterministic scheduling policy without
/// interactivity causing extra preemptions"). A Node is woken by every frame from the
/// Edge and every read from a provider, usually by the very process it then preempts,
/// which had more of the same work to do: left to run, that process hands over a batch
/// and the Node takes it in one go (measured in docs/benchmarks-history.md). It needs no
/// privilege: it only gives up preempting others.
pub fn batch_scheduling() -> std::io::Result<bool> {
    #[cfg(target_os = "linux")]
    {
        #[allow(unsafe_code)]
        // SAFETY: pid 0 names the calling thread; the call takes no pointer.
        let current = unsafe { libc::sched_getscheduler(0) };
        if current == -1 {
            return Err(std::io::Error::last_os_error());
        }
        if current != libc::SCHED_OTHER {
            return Ok(false);
        }
        let param = libc::sched_param { sched_priority: 0 };
        #[allow(unsafe_code)]
        // SAFETY: `param` is an initialised `sched_param` that outlives the call, which
        // only reads it; pid 0 names the calling thread.
        let set = unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &raw const param) };
        if set == -1 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(true)
    }
    #[cfg(not(target_os = "linux"))]
    Ok(false)
}

/// 64 bits that differ between processes (and between calls): the std hasher's random
/// keys, the pid and the clock. Not a secret, only a spread: seeds reconnect jitter so a
/// fleet does not redial in step, and prefixes request ids so they stay unique across
/// restarts.
#[must_use]
pub fn nonce() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    if let Ok(since) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        hasher.write_u128(since.as_nanos());
    }
    hasher.finish()
}

/// Reports an invalid configuration (log and stderr) and gives the exit code (1).
pub fn invalid_config(
    program: &str,
    path: &std::path::Path,
    err: &dyn std::fmt::Display,
) -> ExitCode {
    tracing::error!(config = %path.display(), error = %err, "invalid configuration");
    // The log line first: both say the same, in the order they were written.
    crate::logging::flush();
    eprintln!("{program}: {err}");
    ExitCode::from(1)
}

/// Cancels `shutdown` on the first SIGTERM or SIGINT. Spawn it once at start.
pub async fn cancel_on_signal(shutdown: CancellationToken) {
    cancel_in_stages(vec![(shutdown, "shutdown requested")], false).await;
}

/// Cancels each token of `stages` in turn, one per SIGTERM, SIGINT or SIGQUIT, logging
/// its words: for a graceful stop that a second signal cuts short. SIGQUIT is a stop
/// signal here too, as for a Node (an operator may send every service the same graceful
/// signal); its default, a core dump, would cut everything. Spawn it once at start.
pub async fn cancel_on_signals(stages: Vec<(CancellationToken, &'static str)>) {
    cancel_in_stages(stages, true).await;
}

async fn cancel_in_stages(stages: Vec<(CancellationToken, &'static str)>, with_quit: bool) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return;
    };
    let mut quit = if with_quit {
        signal(SignalKind::quit()).ok()
    } else {
        None
    };
    for (token, what) in stages {
        tokio::select! {
            _ = term.recv() => tracing::info!(signal = "SIGTERM", "{what}"),
            _ = int.recv() => tracing::info!(signal = "SIGINT", "{what}"),
            Some(()) = async {
                match quit.as_mut() {
                    Some(quit) => quit.recv().await,
                    None => std::future::pending().await,
                }
            } => tracing::info!(signal = "SIGQUIT", "{what}"),
        }
        token.cancel();
    }
}

/// Cancels `token` on SIGQUIT (logged), the signal for a graceful stop (as nginx takes it;
/// a container runtime sends it on stop when the image says `STOPSIGNAL SIGQUIT`).
/// Installing it also keeps SIGQUIT's default, a core dump, from ending the process.
/// Spawn it once at start.
pub async fn cancel_on_quit(token: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut quit) = signal(SignalKind::quit()) else {
        return;
    };
    while quit.recv().await.is_some() {
        tracing::info!(signal = "SIGQUIT", "graceful stop requested");
        token.cancel();
    }
}

/// Keeps SIGHUP from ending the process, its default: each one is logged, with `why`
/// it changes nothing. For a binary with nothing to reload (a terminal hanging up, or a
/// script that sends every service SIGHUP, must not cut its work off); spawn it once at
/// start.
pub async fn ignore_hangup(why: &'static str) {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut hup) = signal(SignalKind::hangup()) else {
        return;
    };
    while hup.recv().await.is_some() {
        tracing::warn!(signal = "SIGHUP", "ignored: {why}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scheduling policy of the calling thread, as the kernel reports it
    /// (`/proc/thread-self/stat`, field 41: 0 the default, 3 `SCHED_BATCH`).
    #[cfg(target_os = "linux")]
    fn policy() -> u32 {
        let stat = std::fs::read_to_string("/proc/thread-self/stat").expect("stat");
        let after_name = &stat[stat.rfind(')').expect("name") + 1..];
        // Field 3 is the first after the name.
        after_name
            .split_whitespace()
            .nth(41 - 3)
            .expect("policy")
            .parse()
            .expect("number")
    }

    #[test]
    fn a_pending_response_yields_at_the_next_park_only() {
        std::thread::spawn(|| {
            assert!(!take_response_pending());
            note_response_pending();
            note_response_pending();
            yield_if_response_pending();
            // Consumed by one park: the next waits at once.
            assert!(!take_response_pending());
            note_response_pending();
            // Another thread's runtime is not told.
            let other = std::thread::spawn(take_response_pending)
                .join()
                .expect("thread");
            assert!(!other);
            assert!(take_response_pending());
        })
        .join()
        .expect("thread");
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn batch_scheduling_applies_to_the_thread_and_those_it_starts_once() {
        let started = policy();
        std::thread::spawn(move || {
            if started != 0 {
                // Tests run under `chrt`: that policy is the operator's and stays.
                assert!(!batch_scheduling().expect("kept"));
                assert_eq!(policy(), started);
                return;
            }
            assert!(batch_scheduling().expect("no privilege is needed"));
            assert_eq!(policy(), 3);
            let child = std::thread::spawn(policy).join().expect("child");
            assert_eq!(child, 3, "threads started afterwards inherit it");
            // Already batch: left as it is.
            assert!(!batch_scheduling().expect("kept"));
            assert_eq!(policy(), 3);
        })
        .join()
        .expect("thread");
        assert_eq!(policy(), started, "other threads keep theirs");
    }
}
