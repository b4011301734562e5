//! The one task that dials the Edge and redials it, exactly as the core `Supervisor`
//! decides: the same policy for the initial dial and every reconnect, fatal failures end
//! the process, local shutdown exits 0.

use std::sync::Arc;

use iop_proto_core::cluster::{LinkEvent, MemberLinks};
use iop_proto_core::reconnect::SupervisorState;
use iop_proto_core::{ExitReason, Failure, SessionConfig, Supervisor, SupervisorEvent};
use iop_shell_common::misuse;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::config::NodeConfig;
pub use crate::driver::Stop;
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
    session.cluster = config.follow_cluster;
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

/// Runs until the supervisor of the configured Edge exits; returns why (its
/// `exit_code()` is the process's). A node that follows a cluster also keeps a session
/// with every other member its Edges name ([`follow`]); while one of those sessions is
/// live, the configured Edge is dialled again rather than given up on.
pub async fn run(config: NodeConfig, mut ctx: Context, stop: Stop) -> ExitReason {
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
    // The member links stop with the process, and when the configured Edge's supervisor
    // gives up (a fatal failure: the other Edges would refuse the same).
    let follow_stop = Stop {
        drain: stop.drain.child_token(),
        now: stop.now.child_token(),
    };
    let followers = if config.follow_cluster {
        let heard = Arc::new(driver::MembersHeard::default());
        ctx.members = Some(heard.clone());
        let mut member_ctx = ctx.clone();
        member_ctx.seed = false;
        Some(tokio::spawn(follow(
            heard,
            config.clone(),
            member_ctx,
            link.clone(),
            follow_stop.clone(),
        )))
    } else {
        None
    };
    ctx.seed = true;
    let reason = loop {
        let mut supervisor = match config.backoff {
            Some(backoff) => Supervisor::with_backoff(config.policy, backoff),
            None => Supervisor::with_jitter(config.policy, config.jitter, config.seed),
        };
        let reason = serve(
            &config.edge_addr,
            &mut supervisor,
            &link,
            &config,
            &ctx,
            &stop,
        )
        .await;
        if matches!(reason, ExitReason::Exhausted { .. })
            && ctx.elsewhere.sessions() > 0
            && !stop.drain.is_cancelled()
            && !stop.now.is_cancelled()
        {
            warn!(
                edge = config.edge_addr,
                live_sessions = ctx.elsewhere.sessions(),
                "the configured edge stays unreachable; serving through the cluster's other edges and dialling it again"
            );
            continue;
        }
        break reason;
    };
    match &reason {
        ExitReason::Shutdown => info!("local shutdown"),
        ExitReason::Exhausted { attempts, last } => {
            error!(attempts, last = %last, "giving up: reconnect attempts exhausted");
        }
        ExitReason::Fatal(failure) => error!(failure = %failure, "giving up: fatal error"),
    }
    if let Some(followers) = followers {
        // Each member session stops as the process does (its own drain or grace).
        if !matches!(reason, ExitReason::Shutdown) {
            follow_stop.now.cancel();
        }
        let _ = followers.await;
    }
    // Sessions re-homed away from an earlier Edge process finish their work first (each
    // bounded by its own drain or shutdown grace).
    while ctx.elsewhere.running() > 0 {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    reason
}

/// Keeps a session with every member of the cluster that the node's sessions name,
/// other than the configured Edge, as the core's [`MemberLinks`] decides: one link per
/// member, dialled again without limit while the member is listed, drained once it is
/// not. Ends when the process stops.
async fn follow(
    heard: Arc<driver::MembersHeard>,
    config: NodeConfig,
    ctx: Context,
    link: EdgeLink,
    stop: Stop,
) {
    let mut plan = MemberLinks::default();
    let mut links: std::collections::HashMap<
        String,
        (CancellationToken, tokio::task::JoinHandle<()>),
    > = std::collections::HashMap::new();
    // Links told to leave, draining: waited for at the end too.
    let mut leaving = Vec::new();
    loop {
        let lists = tokio::select! {
            lists = heard.take() => lists,
            () = stop.wait() => break,
        };
        for (from_seed, members) in &lists {
            plan.handle_members(*from_seed, members);
        }
        while let Some(event) = plan.poll_event() {
            match event {
                LinkEvent::Leave { edge_id } => {
                    info!(
                        edge_id,
                        "cluster: this edge left the members; draining its session"
                    );
                    if let Some((leave, task)) = links.remove(&edge_id) {
                        leave.cancel();
                        leaving.push(task);
                    }
                }
                LinkEvent::Dial { edge_id, addr } => {
                    info!(
                        edge_id,
                        addr, "cluster: keeping a session with this edge too"
                    );
                    let leave = stop.drain.child_token();
                    let link_stop = Stop {
                        drain: leave.clone(),
                        now: stop.now.clone(),
                    };
                    let task = tokio::spawn(member_link(
                        addr,
                        config.clone(),
                        ctx.clone(),
                        link.clone(),
                        link_stop,
                    ));
                    links.insert(edge_id, (leave, task));
                }
            }
        }
    }
    leaving.extend(links.into_values().map(|(_, task)| task));
    for task in leaving {
        let _ = task.await;
    }
}

/// One member's link: dialled again without limit until it is told to leave.
async fn member_link(addr: String, config: NodeConfig, ctx: Context, link: EdgeLink, stop: Stop) {
    let policy = iop_proto_core::ReconnectPolicy {
        max_attempts: iop_proto_core::reconnect::MaxAttempts::Unlimited,
        interval: config
            .policy
            .interval
            .max(std::time::Duration::from_millis(100)),
    };
    let seed = config.seed
        ^ addr
            .bytes()
            .fold(0u64, |h, b| h.rotate_left(5) ^ u64::from(b));
    let supervisor = match config.backoff {
        Some(backoff) => Supervisor::with_backoff(policy, backoff),
        None => Supervisor::with_jitter(policy, config.jitter, seed),
    };
    let mut supervisor = supervisor.for_member();
    let reason = serve(&addr, &mut supervisor, &link, &config, &ctx, &stop).await;
    info!(edge = addr, reason = ?reason, "cluster: session with this edge over");
}

/// Dials `addr` and serves over each connection, as `supervisor` decides, until it exits.
async fn serve(
    addr: &str,
    supervisor: &mut Supervisor,
    link: &EdgeLink,
    config: &NodeConfig,
    ctx: &Context,
    stop: &Stop,
) -> ExitReason {
    let clock = ctx.clock;
    misuse("start", supervisor.handle_start(clock.now()));
    loop {
        while let Some(action) = supervisor.poll_event() {
            match action {
                SupervisorEvent::Exit(reason) => return reason,
                SupervisorEvent::Dial { attempt } => {
                    info!(
                        attempt,
                        edge = addr,
                        node_id = config.node_id,
                        "dialing the edge"
                    );
                    let dial = link.connect(addr, config.connect_timeout);
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
                                edge = addr,
                                tls = stream.tls_version().unwrap_or("none"),
                                "connected to the edge"
                            );
                            misuse("connected", supervisor.handle_connected(clock.now()));
                            if TransportStats::get(&ctx.stats.connections) > 0 {
                                TransportStats::add(&ctx.stats.reconnects, 1);
                            }
                            TransportStats::add(&ctx.stats.connections, 1);
                            let session = session_config(config);
                            let end = match stream {
                                Connection::Plain(tcp) => {
                                    driver::run(tcp, session, ctx, supervisor, stop).await
                                }
                                Connection::Tls(tls) => {
                                    driver::run(*tls, session, ctx, supervisor, stop).await
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
                                    warn!(edge = addr, failure = %failure, "session ended");
                                    failed(supervisor, ctx, addr, failure);
                                }
                            }
                        }
                        Err(failure) => {
                            warn!(edge = addr, attempt, failure = %failure, "dial failed");
                            failed(supervisor, ctx, addr, failure);
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
        members: None,
        seed: true,
    })
}

/// Hands `failure` to `supervisor`, telling it first whether other sessions of the node
/// are live (a credential refusal is then not the node's end), and says so when an
/// Edge's refusal of the node's credentials is retried rather than final.
fn failed(supervisor: &mut Supervisor, ctx: &Context, addr: &str, failure: Failure) {
    let now = ctx.clock.now();
    let live_elsewhere = ctx.elsewhere.sessions();
    supervisor.handle_backing(now, live_elsewhere > 0);
    let rejected = matches!(failure, Failure::CredentialRejected(_));
    misuse("failure", supervisor.handle_failure(now, failure));
    if let (true, SupervisorState::Waiting { until }) = (rejected, supervisor.state()) {
        warn!(
            edge = addr,
            configured_edge = ctx.seed,
            live_elsewhere,
            retry_in_ms = until.saturating_duration_since(now).as_millis(),
            "this edge refused the node's credentials; it is dialled again later, since only the configured edge, with no other session live, decides that they are wrong (check the node's token and id if this persists)"
        );
    }
}
