//! `[listen.nodes_tls]` and `[listen.http_tls]`: the listeners' TLS. The node link is
//! TLS unless plaintext is asked for explicitly, and plaintext on a non-loopback address
//! needs a second, louder opt-in.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use iop_shell_common::config::{ConfigError, invalid};
use iop_shell_common::tls::ServerFiles;
use serde::Deserialize;

use super::{RawListen, relative};

/// TLS of both listeners, loaded and checked.
#[derive(Clone, Debug)]
pub struct TlsSettings {
    /// The node link: `None` only with `listen.nodes_plaintext = true`.
    pub nodes: Option<Arc<rustls::ServerConfig>>,
    /// Where the node link's material came from (reloaded on SIGHUP).
    pub nodes_files: Option<ServerFiles>,
    /// HTTPS on the public listener, if configured (ALPN h2, http/1.1).
    pub http: Option<Arc<rustls::ServerConfig>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTls {
    pub(super) cert_file: PathBuf,
    pub(super) key_file: PathBuf,
    pub(super) client_ca_file: Option<PathBuf>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawHttpTls {
    pub(super) cert_file: PathBuf,
    pub(super) key_file: PathBuf,
}

/// The listeners' TLS: the node link is TLS unless plaintext is asked for explicitly, and
/// plaintext on a non-loopback address needs a second, louder opt-in.
pub(super) fn tls_settings(
    listen: &RawListen,
    nodes_addr: SocketAddr,
    path: &Path,
) -> Result<TlsSettings, ConfigError> {
    let nodes_files = match (&listen.nodes_tls, listen.nodes_plaintext) {
        (Some(_), true) => {
            return Err(invalid(
                "listen.nodes_plaintext",
                "set either listen.nodes_tls or nodes_plaintext = true, not both",
            ));
        }
        (None, false) => {
            return Err(invalid(
                "listen.nodes_tls",
                "missing: the node link is TLS; give cert_file and key_file (`iop-edge \
                 gen-cert` makes a self-signed pair), or set listen.nodes_plaintext = true",
            ));
        }
        (None, true) => {
            if !nodes_addr.ip().is_loopback() && !listen.allow_public_plaintext {
                return Err(invalid(
                    "listen.nodes_plaintext",
                    format!(
                        "refused on {nodes_addr}: node tokens, provider keys and every prompt \
                         would cross the network in clear; use listen.nodes_tls, or set \
                         listen.allow_public_plaintext = true if another layer encrypts the link"
                    ),
                ));
            }
            None
        }
        (Some(t), false) => Some(ServerFiles {
            cert_file: relative(path, &t.cert_file),
            key_file: relative(path, &t.key_file),
            client_ca_file: t.client_ca_file.as_ref().map(|f| relative(path, f)),
        }),
    };
    let nodes = nodes_files
        .as_ref()
        .map(|files| iop_shell_common::tls::server_config("listen.nodes_tls", files, &[]))
        .transpose()?;
    let http = listen
        .http_tls
        .as_ref()
        .map(|t| {
            let files = ServerFiles {
                cert_file: relative(path, &t.cert_file),
                key_file: relative(path, &t.key_file),
                client_ca_file: None,
            };
            iop_shell_common::tls::server_config("listen.http_tls", &files, &[b"h2", b"http/1.1"])
        })
        .transpose()?;
    Ok(TlsSettings {
        nodes,
        nodes_files,
        http,
    })
}
