//! Cluster mode (docs/cluster.md): the task that connects the core's
//! [`ClusterMember`] to etcd ([`crate::etcd`]), and the member to the Edge's core and
//! configuration. Every decision is the member's or the core's; this performs the etcd
//! requests the member hands out, runs the watch, and carries answers and events
//! between the two machines.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use iop_proto_core::ConnId;
use iop_proto_core::cluster::{
    ClaimDecision, ClaimTicket, ClusterConfig, ClusterEvent, ClusterMember, EtcdRequest, Member,
    Reply, Tag,
};
use iop_proto_core::wire::{ClusterEdge, ClusterMembers};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::config::{ClusterSettings, Config};
use crate::driver::{Core, CoreMsg};
use crate::etcd::Etcd;
use crate::membership::{Handle, Input, MemberInfo};
use crate::reload::Reloader;

/// What the task needs besides its settings.
pub(crate) struct Parts {
    pub(crate) core: Core,
    pub(crate) reloader: Reloader,
    pub(crate) config_path: PathBuf,
    pub(crate) handle: Handle,
    pub(crate) rx: mpsc::UnboundedReceiver<Input>,
    pub(crate) shutdown: CancellationToken,
    pub(crate) tenants: Arc<crate::tenants::TenantBook>,
}

struct Task {
    member: ClusterMember,
    etcd: Arc<Etcd>,
    parts: Parts,
    clock: iop_shell_common::clock::Clock,
    prefix: String,
    /// Claims asked for, by ticket: the connection waiting.
    tickets: HashMap<ClaimTicket, ConnId>,
    /// Reads of the prefix in flight: a watch starts after each.
    syncs: HashSet<Tag>,
    watch: Option<(u64, tokio::task::JoinHandle<()>)>,
    epoch: u64,
}

/// Runs cluster mode until `shutdown`; leaves the cluster on the way out (its lease is
/// revoked, so the other members see it go at once).
pub(crate) async fn run(settings: ClusterSettings, parts: Parts) {
    let etcd = match Etcd::new(&settings) {
        Ok(etcd) => Arc::new(etcd),
        Err(err) => {
            error!(error = %err, "cluster: cannot reach etcd with these settings; this edge stays out of the cluster");
            return;
        }
    };
    let info = MemberInfo {
        edge_id: String::new(),
        node_addr: settings.advertise_nodes.clone(),
        http_addr: settings.advertise_http.clone(),
        version: env!("CARGO_PKG_VERSION").to_owned(),
    };
    let mut config = ClusterConfig::new(
        &settings.edge_id,
        &settings.prefix,
        serde_json::to_vec(&info).unwrap_or_default(),
    );
    config.lease_ttl = settings.lease_ttl;
    config.keepalive_every = settings.keepalive;
    config.resync_every = settings.resync;
    let clock = parts.core.clock();
    let member = match ClusterMember::new(config, clock.now()) {
        Ok(member) => member,
        Err(err) => {
            error!(error = %err, "cluster: invalid settings; this edge stays out of the cluster");
            return;
        }
    };
    info!(
        edge_id = settings.edge_id,
        endpoints = ?settings.endpoints,
        prefix = settings.prefix,
        advertise_nodes = settings.advertise_nodes,
        "cluster mode: joining through etcd"
    );
    tokio::spawn(crate::response_ids::fetch_key(
        etcd.clone(),
        settings.prefix.clone(),
        parts.handle.view.clone(),
        parts.shutdown.clone(),
    ));
    tokio::spawn(crate::key_sync::run(
        etcd.clone(),
        settings.prefix.clone(),
        settings.edge_id.clone(),
        parts.tenants.clone(),
        parts.shutdown.clone(),
    ));
    let mut task = Task {
        member,
        etcd,
        parts,
        clock,
        prefix: format!("{}/", settings.prefix),
        tickets: HashMap::new(),
        syncs: HashSet::new(),
        watch: None,
        epoch: 0,
    };
    task.run().await;
}

impl Task {
    async fn run(&mut self) {
        let timer = tokio::time::sleep_until(self.clock.instant(iop_proto_core::Timestamp::MAX));
        tokio::pin!(timer);
        loop {
            self.pump().await;
            let deadline = self.clock.instant(
                self.member
                    .poll_timeout()
                    .unwrap_or(iop_proto_core::Timestamp::MAX),
            );
            if timer.deadline() != deadline {
                timer.as_mut().reset(deadline);
            }
            tokio::select! {
                () = self.parts.shutdown.cancelled() => break,
                input = self.parts.rx.recv() => match input {
                    Some(input) => self.on_input(input),
                    None => break,
                },
                () = &mut timer => self.member.handle_timeout(self.clock.now()),
            }
        }
        if let Some((_, watch)) = self.watch.take() {
            watch.abort();
        }
        if let Some(lease) = self.member.lease() {
            // Its member key goes with it: the others see this Edge leave now, not
            // after a TTL.
            let _ = self.etcd.revoke(lease).await;
            info!("cluster: left (lease revoked)");
        }
    }

    fn on_input(&mut self, input: Input) {
        let now = self.clock.now();
        match input {
            Input::Reply(tag, reply) => {
                if self.syncs.remove(&tag)
                    && let Reply::Synced { revision, .. } = &reply
                {
                    self.watch_from(revision + 1);
                }
                if let Err(err) = self.member.handle_reply(now, tag, reply) {
                    warn!(error = %err, "cluster: an answer nobody waited for");
                }
            }
            Input::Watch(epoch, events) => {
                if self.watch.as_ref().is_some_and(|(e, _)| *e == epoch) {
                    self.member.handle_watch(now, events);
                }
            }
            Input::WatchLost(epoch) => {
                if self.watch.as_ref().is_some_and(|(e, _)| *e == epoch) {
                    self.watch = None;
                    self.member.handle_watch_lost(now);
                }
            }
            Input::Claim {
                conn,
                node_id,
                instance,
            } => match self.member.claim_node(now, &node_id, instance) {
                Ok(ticket) => {
                    self.tickets.insert(ticket, conn);
                }
                Err(err) => {
                    warn!(error = %err, "cluster: a node id that cannot be claimed");
                    let _ = self.parts.core.send(CoreMsg::Claimed {
                        conn,
                        decision: ClaimDecision::Unavailable,
                    });
                }
            },
            Input::Release { node_id, instance } => {
                self.member.release_node(now, &node_id, instance);
            }
        }
    }

    /// Starts the watch of the prefix from `start`, replacing any earlier one.
    fn watch_from(&mut self, start: u64) {
        if let Some((_, old)) = self.watch.take() {
            old.abort();
        }
        self.epoch += 1;
        let epoch = self.epoch;
        let etcd = self.etcd.clone();
        let tx = self.parts.handle.tx.clone();
        let prefix = self.prefix.clone();
        let watch = tokio::spawn(async move {
            let deliver = |events| drop(tx.send(Input::Watch(epoch, events)));
            let err = etcd.watch(&prefix, start, deliver).await;
            warn!(error = %err, "cluster: the watch broke; reading the cluster again");
            let _ = tx.send(Input::WatchLost(epoch));
        });
        self.watch = Some((epoch, watch));
    }

    /// Hands out the member's requests and acts on its events until it has none.
    async fn pump(&mut self) {
        loop {
            let mut progressed = false;
            while let Some(transmit) = self.member.poll_transmit() {
                progressed = true;
                if matches!(transmit.request, EtcdRequest::Sync { .. }) {
                    self.syncs.insert(transmit.tag);
                }
                let etcd = self.etcd.clone();
                let tx = self.parts.handle.tx.clone();
                tokio::spawn(async move {
                    let reply = etcd.perform(transmit.request).await;
                    let _ = tx.send(Input::Reply(transmit.tag, reply));
                });
            }
            while let Some(event) = self.member.poll_event() {
                progressed = true;
                self.on_event(event).await;
            }
            if !progressed {
                let view = &self.parts.handle.view;
                view.current
                    .store(self.member.is_synced(), Ordering::Relaxed);
                view.serves.store(self.member.serves(), Ordering::Relaxed);
                let now = self.clock.now();
                let unix = |at: Option<iop_proto_core::Timestamp>| {
                    at.map_or(0, |at| {
                        crate::membership::unix_ms()
                            .saturating_sub(now.saturating_duration_since(at).as_millis() as u64)
                            .max(1)
                    })
                };
                view.detached_since
                    .store(unix(self.member.detached_since()), Ordering::Relaxed);
                view.unanswered_since
                    .store(unix(self.member.unanswered_since()), Ordering::Relaxed);
                if self.member.is_serving() && !view.serving.swap(true, Ordering::Relaxed) {
                    info!("cluster: the shared configuration is in; judging node registers");
                    let _ = self.parts.core.send(CoreMsg::ClusterServing);
                }
                return;
            }
        }
    }

    async fn on_event(&mut self, event: ClusterEvent) {
        let view = &self.parts.handle.view;
        match event {
            ClusterEvent::Joined => {
                view.member.store(true, Ordering::Relaxed);
                info!(edge_id = view.edge_id, "cluster: joined; serving");
            }
            ClusterEvent::Detached(reason) => {
                view.member.store(false, Ordering::Relaxed);
                warn!(
                    edge_id = view.edge_id,
                    reason = ?reason,
                    "cluster: lost the etcd lease (etcd unreachable?): serving on with the nodes, configuration and members last known; no new node instance until etcd answers"
                );
            }
            ClusterEvent::Members(members) => self.members(members),
            ClusterEvent::Configure { revision, text } => {
                let outcome = self.configure(revision, text).await;
                self.member
                    .handle_configured(self.clock.now(), revision, outcome);
            }
            ClusterEvent::Claim { ticket, decision } => {
                if let Some(conn) = self.tickets.remove(&ticket) {
                    let _ = self.parts.core.send(CoreMsg::Claimed { conn, decision });
                }
            }
            ClusterEvent::Fence { node_id, instance } => {
                warn!(
                    node_id,
                    instance = format_args!("{instance:016x}"),
                    "cluster: etcd says another instance holds this node id; draining this one"
                );
                let _ = self
                    .parts
                    .core
                    .send(CoreMsg::ClusterFence { node_id, instance });
            }
        }
    }

    fn members(&mut self, members: Vec<Member>) {
        let infos: Vec<MemberInfo> = members
            .iter()
            .filter_map(|m| {
                let mut info: MemberInfo = serde_json::from_slice(&m.info).ok()?;
                info.edge_id.clone_from(&m.edge_id);
                Some(info)
            })
            .collect();
        info!(
            members = ?infos.iter().map(|m| m.edge_id.as_str()).collect::<Vec<_>>(),
            "cluster: members"
        );
        let wire = ClusterMembers {
            edge_id: self.parts.handle.view.edge_id.clone(),
            members: infos
                .iter()
                .map(|m| ClusterEdge {
                    edge_id: m.edge_id.clone(),
                    node_addr: m.node_addr.clone(),
                })
                .collect(),
        };
        self.parts.handle.view.update(|v| v.members = infos);
        let _ = self.parts.core.send(CoreMsg::ClusterMembers(wire));
    }

    /// Validates and applies the shared configuration of `revision`, as a reload.
    async fn configure(&mut self, revision: u64, text: Vec<u8>) -> Result<(), String> {
        let view = self.parts.handle.view.clone();
        let outcome = self.try_configure(text).await;
        match &outcome {
            Ok(()) => {
                info!(revision, "cluster: shared configuration applied");
                view.update(|v| v.config_revision = revision);
            }
            Err(reason) => {
                error!(
                    revision,
                    reason,
                    "cluster: shared configuration refused; the running configuration stays in force"
                );
                view.update(|v| v.config_refused = Some((revision, reason.clone())));
            }
        }
        outcome
    }

    async fn try_configure(&mut self, text: Vec<u8>) -> Result<(), String> {
        let shared = String::from_utf8(text).map_err(|_| "not UTF-8 text".to_owned())?;
        let path = self.parts.config_path.clone();
        let text = shared.clone();
        let config = tokio::task::spawn_blocking(move || {
            let local = iop_shell_common::config::read(&path)?;
            Config::parse_shared(&local, &text, &path)
        })
        .await
        .map_err(|err| err.to_string())?
        .map_err(|err| err.to_string())?;
        self.parts.reloader.apply(config).await?;
        if let Ok(mut slot) = self.parts.reloader.shared.lock() {
            *slot = Some(shared);
        }
        Ok(())
    }
}

/// What `iop-edge config push` does.
#[derive(Debug, Clone)]
pub struct Push {
    /// The edge's own configuration file (for `[cluster]` and to check the result).
    pub local: PathBuf,
    /// The file whose shared sections go to etcd.
    pub file: PathBuf,
    /// Print the difference from what etcd holds first.
    pub diff: bool,
    /// Only print the difference; push nothing.
    pub dry_run: bool,
    /// How long to wait for every member's answer.
    pub wait: std::time::Duration,
}

/// Line-by-line difference of two texts (`-` removed, `+` added, two spaces kept).
#[must_use]
pub fn line_diff(old: &str, new: &str) -> String {
    let a: Vec<&str> = old.lines().collect();
    let b: Vec<&str> = new.lines().collect();
    let mut out = String::new();
    if a.len() * b.len() > 4_000_000 {
        for line in &a {
            out.push_str(&format!("- {line}\n"));
        }
        for line in &b {
            out.push_str(&format!("+ {line}\n"));
        }
        return out;
    }
    // Longest common subsequence, then walked from the start.
    let mut lcs = vec![vec![0u32; b.len() + 1]; a.len() + 1];
    for i in (0..a.len()).rev() {
        for j in (0..b.len()).rev() {
            lcs[i][j] = if a[i] == b[j] {
                lcs[i + 1][j + 1] + 1
            } else {
                lcs[i + 1][j].max(lcs[i][j + 1])
            };
        }
    }
    let (mut i, mut j) = (0, 0);
    while i < a.len() || j < b.len() {
        if i < a.len() && j < b.len() && a[i] == b[j] {
            out.push_str(&format!("  {}\n", a[i]));
            i += 1;
            j += 1;
        } else if j < b.len() && (i == a.len() || lcs[i][j + 1] >= lcs[i + 1][j]) {
            out.push_str(&format!("+ {}\n", b[j]));
            j += 1;
        } else {
            out.push_str(&format!("- {}\n", a[i]));
            i += 1;
        }
    }
    out
}

/// `iop-edge config push`: checks `push.file`'s shared sections with this edge's own
/// file, writes them to `<prefix>/config` (a compare-and-swap: a push that raced another
/// is refused), then waits for every member's answer and prints it. Returns the exit
/// code: 0 every member applied it, 1 refused before writing, 2 some member refused it
/// or did not answer in time.
pub async fn push(settings: &ClusterSettings, push: &Push) -> u8 {
    let text = match iop_shell_common::config::read(&push.file) {
        Ok(text) => text,
        Err(err) => {
            eprintln!("iop-edge config push: {err}");
            return 1;
        }
    };
    let local = match iop_shell_common::config::read(&push.local) {
        Ok(local) => local,
        Err(err) => {
            eprintln!("iop-edge config push: {err}");
            return 1;
        }
    };
    if let Err(err) = Config::parse_shared(&local, &text, &push.local) {
        eprintln!(
            "iop-edge config push: {} refused before pushing: {err}",
            push.file.display()
        );
        return 1;
    }
    let etcd = match Etcd::new(settings) {
        Ok(etcd) => etcd,
        Err(err) => {
            eprintln!("iop-edge config push: {err}");
            return 1;
        }
    };
    let key = format!("{}/config", settings.prefix);
    let (_, current) = match etcd.get(&key).await {
        Ok(current) => current,
        Err(err) => {
            eprintln!("iop-edge config push: reading {key}: {err}");
            return 1;
        }
    };
    let old = current
        .as_ref()
        .map(|kv| String::from_utf8_lossy(&kv.value).into_owned())
        .unwrap_or_default();
    if push.diff || push.dry_run {
        if old == text {
            println!(
                "no change from revision {}",
                current.as_ref().map_or(0, |kv| kv.mod_revision)
            );
        } else {
            print!("{}", line_diff(&old, &text));
        }
    }
    if push.dry_run {
        return 0;
    }
    let expected = current.as_ref().map_or(0, |kv| kv.mod_revision);
    let started = std::time::Instant::now();
    let revision = match etcd.put_if(&key, text.as_bytes(), expected).await {
        Ok(Some(revision)) => revision,
        Ok(None) => {
            eprintln!("iop-edge config push: {key} changed while this push read it; run it again");
            return 1;
        }
        Err(err) => {
            eprintln!("iop-edge config push: writing {key}: {err}");
            return 1;
        }
    };
    println!("pushed revision {revision} to {key}");
    wait_for_members(&etcd, settings, revision, started, push.wait).await
}

async fn wait_for_members(
    etcd: &Etcd,
    settings: &ClusterSettings,
    revision: u64,
    started: std::time::Instant,
    wait: std::time::Duration,
) -> u8 {
    let members_prefix = format!("{}/members/", settings.prefix);
    let status_prefix = format!("{}/status/", settings.prefix);
    let mut answers: std::collections::BTreeMap<String, Option<(std::time::Duration, String)>> =
        std::collections::BTreeMap::new();
    loop {
        let members = etcd.range(&members_prefix).await.map(|(_, kvs)| kvs);
        let statuses = etcd.range(&status_prefix).await.map(|(_, kvs)| kvs);
        let elapsed = started.elapsed();
        if let (Ok(members), Ok(statuses)) = (members, statuses) {
            for member in &members {
                let id = member.key.trim_start_matches(&members_prefix).to_owned();
                let entry = answers.entry(id.clone()).or_insert(None);
                if entry.is_some() {
                    continue;
                }
                let status = statuses
                    .iter()
                    .find(|s| s.key.trim_start_matches(&status_prefix) == id)
                    .map(|s| String::from_utf8_lossy(&s.value).into_owned());
                if let Some(status) = status {
                    let (rev, outcome) = status.split_once(' ').unwrap_or((&status, ""));
                    if rev.parse::<u64>().is_ok_and(|r| r >= revision) {
                        *entry = Some((elapsed, outcome.to_owned()));
                    }
                }
            }
        }
        let done = !answers.is_empty() && answers.values().all(Option::is_some);
        if done || elapsed >= wait {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let mut code = 0;
    if answers.is_empty() {
        println!("no member is in the cluster now: every edge applies it when it joins");
    }
    for (edge, answer) in &answers {
        match answer {
            Some((after, outcome)) if outcome == "ok" => {
                println!("{edge}: applied after {:.3} s", after.as_secs_f64());
            }
            Some((_, outcome)) => {
                println!("{edge}: {outcome}");
                code = 2;
            }
            None => {
                println!("{edge}: no answer within {} s", wait.as_secs());
                code = 2;
            }
        }
    }
    code
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_diff_marks_removed_added_and_kept_lines() {
        let diff = line_diff("a\nb\nc\n", "a\nc\nd\n");
        assert_eq!(diff, "  a\n- b\n  c\n+ d\n");
        assert_eq!(line_diff("", "x\n"), "+ x\n");
    }
}
