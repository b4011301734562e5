//! The one task that dials the Edge and redials it, exactly as the core `Supervisor`
//! decides: the same policy for the initial dial and every reconnect, fatal failures end
//! the process, local shutdown exits 0.

use std::sync::Arc;

use iop_proto_core::{ExitReason, SessionConfig, Supervisor, SupervisorEvent};
use iop_shell_common::misuse;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::config::NodeConfig;
use crate::driver::{self, Context};
use crate::link::{Connection, EdgeLink};
use crate::stats::TransportStats;

/// The session settings a connection uses.
#[must_use]
pub fn session_config(config: &NodeConfig) -> SessionConfig {
    let mut session = SessionConfig::new(config.node_id.clone(), config.token.expose().to_owned());
    session.version = env!("CARGO_PKG_VERSION").to_owned();
    session.labels = config.labels.clone();
    session.instance_id = instance_id();
    session.handshake_timeout = config.handshake_timeout;
    session.shutdown_grace = config.shutdown_grace;
    session.drain_grace = config.drain_grace;
    session.rehome = true;
    session
}

/// This process's instance id (see [`SessionConfig::instance_id`]): random, drawn once,
/// never 0. Not a secret; it only has to differ between two processes.
fn instance_id() -> u64 {
    static INSTANCE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *INSTANCE.get_or_init(|| {
        let mut bytes = [0u8; 8];
        let random = rustls::crypto::ring::default_provider()
            .secure_random
            .fill(&mut bytes);
        if random.is_err() {
            // No system randomness: the process id and start time still tell two
            // processes apart.
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            bytes = (u64::from(std::process::id()) << 32 ^ nanos as u64).to_le_bytes();
        }
        u64::from_le_bytes(bytes).max(1)
    })
}

/// How the process was asked to stop: one token per way, each cancelled once.
#[derive(Clone, Debug, Default)]
pub struct Stop {
    /// Graceful (`SIGQUIT`): the Edge is asked to send nothing more and the work in flight
    /// runs to its end, up to `timeouts.drain_grace_sec`.
    pub drain: CancellationToken,
    /// Quick (`SIGTERM`, `SIGINT`): the work in flight is cancelled.
    pub now: CancellationToken,
}

impl Stop {
    /// Waits until either stop is asked for.
    pub async fn wait(&self) {
        tokio::select! {
            () = self.drain.cancelled() => {}
            () = self.now.cancelled() => {}
        }
    }
}

/// Runs until the supervisor exits; returns why (its `exit_code()` is the process's).
pub async fn run(config: NodeConfig, ctx: Context, stop: Stop) -> ExitReason {
    let link = match EdgeLink::new(&config.link) {
        Ok(link) => link,
        Err(err) => {
            let failure = iop_proto_core::Failure::LocalConfig(err);
            error!(failure = %failure, "giving up: fatal error");
            return ExitReason::Fatal(failure);
        }
    };
    if matches!(link, EdgeLink::Plain) {
        warn!(
            edge = config.edge_addr,
            "the link to the edge is PLAINTEXT (edge_tls.plaintext = true): the token, provider \
             keys and every prompt cross it in clear"
        );
    }
    let mut supervisor = match config.backoff {
        Some(backoff) => Supervisor::with_backoff(config.policy, backoff),
        None => Supervisor::with_jitter(config.policy, config.jitter, config.seed),
    };
    let clock = ctx.clock;
    misuse("start", supervisor.handle_start(clock.now()));
    loop {
        while let Some(action) = supervisor.poll_event() {
            match action {
                SupervisorEvent::Exit(reason) => {
                    match &reason {
                        ExitReason::Shutdown => info!("local shutdown"),
                        ExitReason::Exhausted { attempts, last } => {
                            error!(attempts, last = %last, "giving up: reconnect attempts exhausted");
                        }
                        ExitReason::Fatal(failure) => {
                            error!(failure = %failure, "giving up: fatal error")
                        }
                    }
                    // Sessions re-homed away from an earlier Edge process finish their
                    // work first (each bounded by its own drain or shutdown grace).
                    while ctx.elsewhere.running() > 0 {
                        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                    }
                    return reason;
                }
                SupervisorEvent::Dial { attempt } => {
                    info!(
                        attempt,
                        edge = config.edge_addr,
                        node_id = config.node_id,
                        "dialing the edge"
                    );
                    let dial = link.connect(&config.edge_addr, config.connect_timeout);
                    let stream = tokio::select! {
                        () = stop.wait() => {
                            supervisor.handle_shutdown(clock.now());
                            continue;
                        }
                        result = dial => result,
                    };
                    match stream {
                        Ok(stream) => {
                            info!(
                                edge = config.edge_addr,
                                tls = stream.tls_version().unwrap_or("none"),
                                "connected to the edge"
                            );
                            misuse("connected", supervisor.handle_connected(clock.now()));
                            if TransportStats::get(&ctx.stats.connections) > 0 {
                                TransportStats::add(&ctx.stats.reconnects, 1);
                            }
                            TransportStats::add(&ctx.stats.connections, 1);
                            let session = session_config(&config);
                            let end = match stream {
                                Connection::Plain(tcp) => {
                                    driver::run(tcp, session, &ctx, &mut supervisor, &stop).await
                                }
                                Connection::Tls(tls) => {
                                    driver::run(*tls, session, &ctx, &mut supervisor, &stop).await
                                }
                            };
                            let end = match end {
                                driver::Ended::Closed(end) => end,
                                // The supervisor dials again at once.
                                driver::Ended::Rehomed => continue,
                            };
                            // After a stop (`handle_stop`, from the driver) the core's
                            // supervisor exits however the session ended.
                            match end.failure() {
                                None => supervisor.handle_shutdown(clock.now()),
                                Some(failure) => {
                                    warn!(failure = %failure, "session ended");
                                    misuse(
                                        "failure",
                                        supervisor.handle_failure(clock.now(), failure),
                                    );
                                }
                            }
                        }
                        Err(failure) => {
                            warn!(attempt, failure = %failure, "dial failed");
                            misuse("failure", supervisor.handle_failure(clock.now(), failure));
                        }
                    }
                }
            }
        }
        let Some(at) = supervisor.poll_timeout().map(|wake| wake.at) else {
            continue;
        };
        tokio::select! {
            () = stop.wait() => supervisor.handle_shutdown(clock.now()),
            () = tokio::time::sleep_until(clock.instant(at)) => supervisor.handle_timeout(clock.now()),
        }
    }
}

/// Process-wide pieces a supervisor needs; fails on an unusable TLS configuration.
pub fn context(config: &NodeConfig) -> Result<Context, String> {
    Ok(Context {
        clock: iop_shell_common::clock::Clock::new(),
        stats: Arc::new(TransportStats::default()),
        http: crate::adapters::http::client(config.ca_file.as_deref())?,
        request_timeout: config.request_timeout,
        started: tokio::time::Instant::now(),
        drain_grace: config.drain_grace,
        elsewhere: driver::Elsewhere::default(),
    })
}
