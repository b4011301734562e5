//! The Node's local configuration file (TOML). It holds only what a node needs before it
//! reaches the Edge: the Edge address and how to check it, its identity and token, the
//! reconnect policy and timeouts. Adapter configuration comes from the Edge, never from
//! this file.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use iop_proto_core::ReconnectPolicy;
use iop_proto_core::reconnect::Backoff;
use rustls::RootCertStore;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use serde::Deserialize;

/// Shortest token accepted (the Edge refuses shorter ones too).
pub const MIN_TOKEN_CHARS: usize = 16;

/// Environment variable read for the token when the file sets neither `token` nor
/// `token_file`.
pub const TOKEN_ENV: &str = "IOP_NODE_TOKEN";

/// Default `reconnect.jitter`: each wait is drawn from 80-100% of `interval_sec` (the
/// core's reconnect policy).
pub use iop_proto_core::reconnect::DEFAULT_JITTER;

/// A secret that never prints.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// The secret value, for the one place that sends it.
    #[must_use]
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

pub use iop_shell_common::config::ConfigError;
use iop_shell_common::config::invalid;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    node_id: String,
    edge_addr: String,
    token: Option<String>,
    token_file: Option<PathBuf>,
    edge_cert_sha256: Option<String>,
    #[serde(default)]
    edge_tls: RawEdgeTls,
    #[serde(default)]
    labels: BTreeMap<String, String>,
    #[serde(default)]
    reconnect: RawReconnect,
    #[serde(default)]
    timeouts: RawTimeouts,
    #[serde(default)]
    tls: RawTls,
    #[serde(default)]
    runtime: RawRuntime,
    #[serde(default = "follow_cluster_default")]
    follow_cluster: bool,
}

fn follow_cluster_default() -> bool {
    true
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRuntime {
    scheduler: Option<String>,
}

/// How the node asks the kernel to schedule it (`runtime.scheduler`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Scheduler {
    /// `"batch"` (the default): Linux's `SCHED_BATCH`, unless the node was started under
    /// a policy other than the default ([`iop_shell_common::process::batch_scheduling`]).
    #[default]
    Batch,
    /// `"inherit"`: whatever the node was started with.
    Inherit,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTls {
    ca_file: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEdgeTls {
    ca_file: Option<PathBuf>,
    server_name: Option<String>,
    cert_file: Option<PathBuf>,
    key_file: Option<PathBuf>,
    #[serde(default)]
    plaintext: bool,
}

/// How the node decides that the peer at `edge_addr` is its Edge.
#[derive(Clone, Debug)]
pub enum EdgeTrust {
    /// Exactly the certificate with this SHA-256 digest (`edge_cert_sha256`).
    Pinned([u8; 32]),
    /// A certificate for the server name issued by one of these roots (`edge_tls.ca_file`,
    /// else the Mozilla roots).
    Roots(Arc<RootCertStore>),
}

/// A client certificate chain and its key, for an Edge that requires mutual TLS.
pub type ClientCert = Arc<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>;

/// The link to the Edge.
#[derive(Clone, Debug)]
pub enum LinkConfig {
    /// Plain TCP: `edge_tls.plaintext = true`, for an Edge that also opted in.
    Plain,
    /// TLS (the default).
    Tls {
        /// How the Edge is checked.
        trust: EdgeTrust,
        /// SNI and the name checked against a CA-issued certificate.
        server_name: ServerName<'static>,
        /// The node's own certificate, if it has one.
        client_cert: Option<ClientCert>,
    },
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawReconnect {
    max_attempts: Option<i64>,
    interval_sec: Option<f64>,
    jitter: Option<f64>,
    seed: Option<u64>,
    backoff: Option<RawBackoff>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBackoff {
    base_ms: u64,
    max_ms: u64,
    #[serde(default)]
    jitter: f64,
    seed: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTimeouts {
    connect_sec: Option<f64>,
    handshake_sec: Option<f64>,
    request_sec: Option<f64>,
    shutdown_grace_sec: Option<f64>,
    drain_grace_sec: Option<f64>,
}

/// A validated node configuration.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// Node identity, as configured on the Edge.
    pub node_id: String,
    /// `host:port` of the Edge's node listener.
    pub edge_addr: String,
    /// TLS or plaintext, and how the Edge is checked.
    pub link: LinkConfig,
    /// The node's token.
    pub token: Secret,
    /// Labels reported at register.
    pub labels: BTreeMap<String, String>,
    /// Reconnect policy (initial dial and every reconnect).
    pub policy: ReconnectPolicy,
    /// Fraction of the fixed interval removed at random from each wait (default
    /// [`DEFAULT_JITTER`]), so a fleet that lost the same Edge does not redial at once.
    pub jitter: f64,
    /// Seed of the jitter: configured, or drawn per process.
    pub seed: u64,
    /// Optional exponential backoff instead of the fixed interval.
    pub backoff: Option<Backoff>,
    /// Dial timeout.
    pub connect_timeout: Duration,
    /// Register + configure + ready must complete within this.
    pub handshake_timeout: Duration,
    /// Default upper bound of one provider request when the Edge sends none.
    pub request_timeout: Duration,
    /// How long shutdown waits for cancelled work to end in order.
    pub shutdown_grace: Duration,
    /// After `SIGQUIT` (a graceful stop), how long the work in flight may run to its end
    /// before it is cancelled.
    pub drain_grace: Duration,
    /// Extra CA certificates (PEM) trusted for `https://` providers.
    pub ca_file: Option<PathBuf>,
    /// How the node asks the kernel to schedule it.
    pub scheduler: Scheduler,
    /// Whether the node keeps a session with every Edge of a cluster (`follow_cluster`,
    /// default true; docs/cluster.md). A single Edge ignores it.
    pub follow_cluster: bool,
}

fn seconds(key: &'static str, value: Option<f64>, default: f64) -> Result<Duration, ConfigError> {
    let secs = value.unwrap_or(default);
    match Duration::try_from_secs_f64(secs) {
        Ok(d) if !d.is_zero() => Ok(d),
        _ => Err(invalid(
            key,
            format!("must be a positive number of seconds, got {secs}"),
        )),
    }
}

/// The longest graceful stop a configuration may ask for: a day.
const MAX_DRAIN_GRACE_SEC: f64 = 86_400.0;

/// `timeouts.drain_grace_sec`: 30 s by default; 0 cancels at once, as `SIGTERM` does.
fn drain_grace(value: Option<f64>) -> Result<Duration, ConfigError> {
    let secs = value.unwrap_or(30.0);
    if !(0.0..=MAX_DRAIN_GRACE_SEC).contains(&secs) {
        return Err(invalid(
            "timeouts.drain_grace_sec",
            format!("must be between 0 and {MAX_DRAIN_GRACE_SEC} seconds, got {secs}"),
        ));
    }
    Ok(Duration::from_secs_f64(secs))
}

impl NodeConfig {
    /// Reads and validates `path`; the token may come from the environment.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = iop_shell_common::config::read(path)?;
        Self::parse(&text, path, std::env::var(TOKEN_ENV).ok())
    }

    /// Parses and validates configuration text. `env_token` is the value of
    /// [`TOKEN_ENV`], if set. Relative `token_file` paths resolve against `path`'s folder.
    pub fn parse(text: &str, path: &Path, env_token: Option<String>) -> Result<Self, ConfigError> {
        let raw: RawConfig = iop_shell_common::config::parse_toml(text, path)?;
        if raw.node_id.trim().is_empty() {
            return Err(invalid("node_id", "must not be empty"));
        }
        if !iop_proto_core::cluster::dialable(&raw.edge_addr) {
            return Err(invalid(
                "edge_addr",
                format!("must be host:port, got {:?}", raw.edge_addr),
            ));
        }
        let token = match (raw.token, raw.token_file) {
            (Some(_), Some(_)) => {
                return Err(invalid("token", "set either token or token_file, not both"));
            }
            (Some(token), None) => token,
            (None, Some(file)) => {
                let file = path.parent().map_or(file.clone(), |dir| dir.join(&file));
                iop_shell_common::config::read_text(&file)
                    .map_err(|err| {
                        invalid(
                            "token_file",
                            format!("cannot read {}: {err}", file.display()),
                        )
                    })?
                    .trim()
                    .to_owned()
            }
            (None, None) => env_token.ok_or_else(|| {
                invalid(
                    "token",
                    format!(
                        "missing: set token, token_file or the {TOKEN_ENV} environment variable"
                    ),
                )
            })?,
        };
        if token.chars().count() < MIN_TOKEN_CHARS {
            return Err(invalid(
                "token",
                format!("must have at least {MIN_TOKEN_CHARS} characters"),
            ));
        }
        let link = link_config(
            &raw.edge_addr,
            raw.edge_cert_sha256.as_deref(),
            &raw.edge_tls,
            path,
        )?;
        let policy =
            ReconnectPolicy::from_config(raw.reconnect.max_attempts, raw.reconnect.interval_sec)
                .map_err(|err| invalid("reconnect", err.to_string()))?;
        let jitter = raw.reconnect.jitter.unwrap_or(DEFAULT_JITTER);
        if !(0.0..=1.0).contains(&jitter) {
            return Err(invalid(
                "reconnect.jitter",
                format!("must be a fraction between 0 and 1, got {jitter}"),
            ));
        }
        let seed = raw
            .reconnect
            .seed
            .unwrap_or_else(iop_shell_common::process::nonce);
        let backoff = match raw.reconnect.backoff {
            None => None,
            Some(b) => {
                if b.base_ms == 0 || b.max_ms < b.base_ms || !(0.0..=1.0).contains(&b.jitter) {
                    return Err(invalid(
                        "reconnect.backoff",
                        "needs 0 < base_ms <= max_ms and 0 <= jitter <= 1",
                    ));
                }
                Some(Backoff {
                    base: Duration::from_millis(b.base_ms),
                    max: Duration::from_millis(b.max_ms),
                    jitter: b.jitter,
                    seed: b.seed.unwrap_or(seed),
                })
            }
        };
        let scheduler = match raw.runtime.scheduler.as_deref() {
            None | Some("batch") => Scheduler::Batch,
            Some("inherit") => Scheduler::Inherit,
            Some(other) => {
                return Err(invalid(
                    "runtime.scheduler",
                    format!("must be \"batch\" or \"inherit\", got {other:?}"),
                ));
            }
        };
        Ok(NodeConfig {
            node_id: raw.node_id,
            edge_addr: raw.edge_addr,
            link,
            token: Secret(token),
            labels: raw.labels,
            policy,
            jitter,
            seed,
            backoff,
            connect_timeout: seconds("timeouts.connect_sec", raw.timeouts.connect_sec, 5.0)?,
            handshake_timeout: seconds("timeouts.handshake_sec", raw.timeouts.handshake_sec, 10.0)?,
            request_timeout: seconds("timeouts.request_sec", raw.timeouts.request_sec, 600.0)?,
            shutdown_grace: seconds(
                "timeouts.shutdown_grace_sec",
                raw.timeouts.shutdown_grace_sec,
                5.0,
            )?,
            drain_grace: drain_grace(raw.timeouts.drain_grace_sec)?,
            ca_file: raw
                .tls
                .ca_file
                .map(|file| path.parent().map_or(file.clone(), |dir| dir.join(&file))),
            scheduler,
            follow_cluster: raw.follow_cluster,
        })
    }
}

fn link_config(
    edge_addr: &str,
    pin: Option<&str>,
    tls: &RawEdgeTls,
    path: &Path,
) -> Result<LinkConfig, ConfigError> {
    let relative = |file: &Path| path.parent().map_or(file.to_owned(), |dir| dir.join(file));
    if tls.plaintext {
        if pin.is_some()
            || tls.ca_file.is_some()
            || tls.server_name.is_some()
            || tls.cert_file.is_some()
            || tls.key_file.is_some()
        {
            return Err(invalid(
                "edge_tls.plaintext",
                "plaintext leaves no TLS setting to use; remove it or the TLS settings",
            ));
        }
        return Ok(LinkConfig::Plain);
    }
    let trust = match (pin, &tls.ca_file) {
        (Some(_), Some(_)) => {
            return Err(invalid(
                "edge_cert_sha256",
                "set either edge_cert_sha256 or edge_tls.ca_file, not both",
            ));
        }
        (Some(pin), None) => EdgeTrust::Pinned(
            iop_shell_common::tls::parse_fingerprint(pin).ok_or_else(|| {
                invalid(
                    "edge_cert_sha256",
                    "must be 64 hex digits (colons allowed), as `iop-edge gen-cert` prints it",
                )
            })?,
        ),
        (None, ca) => {
            let extra = match ca {
                Some(file) => {
                    iop_shell_common::tls::read_certs("edge_tls.ca_file", &relative(file))?
                }
                None => Vec::new(),
            };
            EdgeTrust::Roots(Arc::new(
                roots(&extra).map_err(|err| invalid("edge_tls.ca_file", err))?,
            ))
        }
    };
    let host = match &tls.server_name {
        Some(name) => name.clone(),
        None => {
            let (host, _) = edge_addr.rsplit_once(':').unwrap_or((edge_addr, ""));
            host.trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned()
        }
    };
    let server_name = ServerName::try_from(host.clone()).map_err(|_| {
        invalid(
            "edge_tls.server_name",
            format!("{host:?} is not a DNS name or an IP address"),
        )
    })?;
    let client_cert = match (&tls.cert_file, &tls.key_file) {
        (None, None) => None,
        (Some(cert), Some(key)) => Some(Arc::new((
            iop_shell_common::tls::read_certs("edge_tls.cert_file", &relative(cert))?,
            iop_shell_common::tls::read_key("edge_tls.key_file", &relative(key))?,
        ))),
        _ => {
            return Err(invalid(
                "edge_tls.cert_file",
                "a client certificate needs both edge_tls.cert_file and edge_tls.key_file",
            ));
        }
    };
    Ok(LinkConfig::Tls {
        trust,
        server_name,
        client_cert,
    })
}

/// The Mozilla roots, plus the certificates of `extra` if given.
pub fn roots(extra: &[CertificateDer<'static>]) -> Result<RootCertStore, String> {
    let mut roots = RootCertStore::empty();
    if extra.is_empty() {
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    }
    for cert in extra {
        roots
            .add(cert.clone())
            .map_err(|err| format!("edge_tls.ca_file: {err}"))?;
    }
    Ok(roots)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<NodeConfig, ConfigError> {
        NodeConfig::parse(text, Path::new("/nonexistent/node.toml"), None)
    }

    #[test]
    fn minimal_config_takes_the_contract_defaults() {
        let cfg = parse(
            "node_id = \"n1\"\nedge_addr = \"127.0.0.1:7100\"\ntoken = \"t-0123456789abcdef\"\n",
        )
        .expect("valid");
        assert_eq!(cfg.policy, ReconnectPolicy::default());
        assert_eq!(cfg.jitter, DEFAULT_JITTER);
        assert_eq!(cfg.connect_timeout, Duration::from_secs(5));
        assert!(
            !format!("{cfg:?}").contains("0123456789abcdef"),
            "token printed"
        );
        assert!(
            matches!(
                cfg.link,
                LinkConfig::Tls {
                    trust: EdgeTrust::Roots(_),
                    ..
                }
            ),
            "TLS with the web roots unless told otherwise"
        );
    }

    #[test]
    fn the_scheduler_is_batch_unless_told_to_inherit() {
        let text = "node_id = \"n1\"\nedge_addr = \"a:1\"\ntoken = \"t-0123456789abcdef\"\n";
        assert_eq!(parse(text).expect("valid").scheduler, Scheduler::Batch);
        let with = |value: &str| parse(&format!("{text}[runtime]\nscheduler = {value}\n"));
        assert_eq!(
            with("\"batch\"").expect("valid").scheduler,
            Scheduler::Batch
        );
        assert_eq!(
            with("\"inherit\"").expect("valid").scheduler,
            Scheduler::Inherit
        );
        let err = with("\"fifo\"").expect_err("not a choice").to_string();
        assert!(
            err.contains("runtime.scheduler") && err.contains("fifo"),
            "{err}"
        );
        assert!(with("1").is_err());
    }

    #[test]
    fn jitter_seeds_differ_per_process_unless_configured() {
        let text = "node_id = \"n1\"\nedge_addr = \"a:1\"\ntoken = \"t-0123456789abcdef\"\n";
        let (a, b) = (parse(text).expect("valid"), parse(text).expect("valid"));
        assert_ne!(
            a.seed, b.seed,
            "two nodes with one file must not redial in step"
        );
        let pinned = parse(&format!("{text}[reconnect]\njitter = 0\nseed = 7\n")).expect("valid");
        assert_eq!((pinned.jitter, pinned.seed), (0.0, 7));
    }

    #[test]
    fn a_graceful_stop_waits_30_s_by_default_and_0_cancels_at_once() {
        let text = "node_id = \"n1\"\nedge_addr = \"a:1\"\ntoken = \"t-0123456789abcdef\"\n";
        assert_eq!(
            parse(text).expect("valid").drain_grace,
            Duration::from_secs(30)
        );
        let zero = parse(&format!("{text}[timeouts]\ndrain_grace_sec = 0\n")).expect("valid");
        assert_eq!(zero.drain_grace, Duration::ZERO);
    }

    #[test]
    fn errors_name_the_key() {
        let cases = [
            (
                "node_id = \"\"\nedge_addr = \"a:1\"\ntoken = \"t-0123456789abcdef\"",
                "node_id",
            ),
            (
                "node_id = \"n\"\nedge_addr = \"nope\"\ntoken = \"t-0123456789abcdef\"",
                "edge_addr",
            ),
            ("node_id = \"n\"\nedge_addr = \"a:1\"", "token"),
            (
                "node_id = \"n\"\nedge_addr = \"a:1\"\ntoken = \"t-0123456789abcdef\"\n[reconnect]\nmax_attempts = -1",
                "reconnect",
            ),
            (
                "node_id = \"n\"\nedge_addr = \"a:1\"\ntoken = \"t-0123456789abcdef\"\n[reconnect]\nmax_attempts = 0\ninterval_sec = 0",
                "reconnect",
            ),
            (
                "node_id = \"n\"\nedge_addr = \"a:1\"\ntoken = \"t-0123456789abcdef\"\n[reconnect]\njitter = 1.5",
                "reconnect.jitter",
            ),
            (
                "node_id = \"n\"\nedge_addr = \"a:1\"\ntoken = \"t-0123456789abcdef\"\n[timeouts]\nconnect_sec = -2",
                "timeouts.connect_sec",
            ),
            (
                "node_id = \"n\"\nedge_addr = \"a:1\"\ntoken = \"t-0123456789abcdef\"\n[timeouts]\ndrain_grace_sec = -1",
                "timeouts.drain_grace_sec",
            ),
            (
                "node_id = \"n\"\nedge_addr = \"a:1\"\ntoken = \"t-0123456789abcdef\"\n[timeouts]\ndrain_grace_sec = 86401",
                "timeouts.drain_grace_sec",
            ),
            (
                "node_id = \"n\"\nedge_addr = \"a:1\"\ntoken = \"t-0123456789abcdef\"\n[timeouts]\ndrain_grace_sec = nan",
                "timeouts.drain_grace_sec",
            ),
            (
                "node_id = \"n\"\nedge_addr = \"a:1\"\ntoken = \"t-0123456789abcdef\"\nadapters = []",
                "adapters",
            ),
            (
                "node_id = \"n\"\nedge_addr = \"a:1\"\ntoken = \"short\"",
                "token",
            ),
            (
                "node_id = \"n\"\nedge_addr = \"a:1\"\ntoken = \"t-0123456789abcdef\"\nedge_cert_sha256 = \"AB:CD\"",
                "edge_cert_sha256",
            ),
            (
                "node_id = \"n\"\nedge_addr = \"a:1\"\ntoken = \"t-0123456789abcdef\"\n[edge_tls]\nplaintext = true\nserver_name = \"x\"",
                "edge_tls.plaintext",
            ),
            (
                "node_id = \"n\"\nedge_addr = \"a:1\"\ntoken = \"t-0123456789abcdef\"\n[edge_tls]\ncert_file = \"c.pem\"",
                "edge_tls.cert_file",
            ),
            (
                "node_id = \"n\"\nedge_addr = \"a:1\"\ntoken = \"t-0123456789abcdef\"\n[edge_tls]\nca_file = \"/nonexistent/ca.pem\"",
                "edge_tls.ca_file",
            ),
        ];
        for (text, key) in cases {
            let err = parse(text).expect_err(text).to_string();
            assert!(err.contains(key), "{err} does not name {key}");
        }
    }

    #[test]
    fn the_edge_is_pinned_by_fingerprint_and_named_by_its_address() {
        let pin = "ab:".repeat(31) + "ab";
        let cfg = parse(&format!(
            "node_id = \"n\"\nedge_addr = \"edge.example:7100\"\ntoken = \"t-0123456789abcdef\"\nedge_cert_sha256 = \"{pin}\""
        ))
        .expect("valid");
        let LinkConfig::Tls {
            trust: EdgeTrust::Pinned(digest),
            server_name,
            client_cert: None,
        } = cfg.link
        else {
            panic!("pinned TLS: {:?}", cfg.link);
        };
        assert_eq!(digest, [0xab; 32]);
        assert_eq!(server_name.to_str(), "edge.example");
        let plain = parse(
            "node_id = \"n\"\nedge_addr = \"a:1\"\ntoken = \"t-0123456789abcdef\"\n[edge_tls]\nplaintext = true",
        )
        .expect("valid");
        assert!(matches!(plain.link, LinkConfig::Plain));
    }

    #[test]
    fn token_may_come_from_the_environment() {
        let cfg = NodeConfig::parse(
            "node_id = \"n\"\nedge_addr = \"a:1\"",
            Path::new("x.toml"),
            Some("from-env-0123456789".into()),
        )
        .expect("valid");
        assert_eq!(cfg.token.expose(), "from-env-0123456789");
    }
}
