//! The link to the Edge: a TCP dial, then TLS unless the operator chose plaintext on both
//! sides. The Node checks the Edge before it sends anything of its own (its token goes in
//! the first frame, after the handshake): by a pinned SHA-256 certificate fingerprint, by
//! a CA file, or by the Mozilla roots. With a client certificate it also proves itself
//! to an Edge that requires mutual TLS.

use std::sync::Arc;
use std::time::Duration;

use iop_proto_core::Failure;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, SignatureScheme};
use subtle::ConstantTimeEq;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

use crate::config::{EdgeTrust, LinkConfig};

/// How this node reaches its Edge.
#[derive(Clone)]
pub enum EdgeLink {
    /// Plain TCP (both sides opted in).
    Plain,
    /// TLS with the Edge checked as configured.
    Tls {
        /// The client side of the handshake.
        connector: TlsConnector,
        /// The name sent as SNI and checked against the certificate (unless pinned).
        server_name: ServerName<'static>,
    },
}

impl std::fmt::Debug for EdgeLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EdgeLink::Plain => f.write_str("EdgeLink::Plain"),
            EdgeLink::Tls { server_name, .. } => {
                write!(f, "EdgeLink::Tls({})", server_name.to_str())
            }
        }
    }
}

/// An established connection to the Edge.
#[derive(Debug)]
pub enum Connection {
    /// Plain TCP.
    Plain(TcpStream),
    /// TLS; the negotiated version is in the session.
    Tls(Box<TlsStream<TcpStream>>),
}

impl EdgeLink {
    /// The link `config` describes; fails on unusable TLS material.
    pub fn new(config: &LinkConfig) -> Result<Self, String> {
        let LinkConfig::Tls {
            trust,
            server_name,
            client_cert,
        } = config
        else {
            return Ok(EdgeLink::Plain);
        };
        let provider = iop_shell_common::tls::provider();
        let builder = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|err| format!("tls: {err}"))?;
        let builder = match trust {
            EdgeTrust::Pinned(digest) => {
                builder
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(Pinned {
                        digest: *digest,
                        algorithms: provider.signature_verification_algorithms,
                    }))
            }
            EdgeTrust::Roots(roots) => builder.with_root_certificates(roots.clone()),
        };
        let tls = match client_cert {
            None => builder.with_no_client_auth(),
            Some(pair) => builder
                .with_client_auth_cert(pair.0.clone(), pair.1.clone_key())
                .map_err(|err| {
                    format!("edge_tls.key_file does not fit edge_tls.cert_file: {err}")
                })?,
        };
        Ok(EdgeLink::Tls {
            connector: TlsConnector::from(Arc::new(tls)),
            server_name: server_name.clone(),
        })
    }

    /// Dials `addr` and, for TLS, completes the handshake, all within `timeout`.
    pub async fn connect(&self, addr: &str, timeout: Duration) -> Result<Connection, Failure> {
        let dial = async {
            let stream = TcpStream::connect(addr)
                .await
                .map_err(|err| Failure::from_io(err.kind(), &err))?;
            let _ = stream.set_nodelay(true);
            match self {
                EdgeLink::Plain => Ok(Connection::Plain(stream)),
                EdgeLink::Tls {
                    connector,
                    server_name,
                } => connector
                    .connect(server_name.clone(), stream)
                    .await
                    .map(|tls| Connection::Tls(Box::new(tls)))
                    .map_err(|err| tls_failure(&err)),
            }
        };
        tokio::time::timeout(timeout, dial)
            .await
            .map_err(|_| Failure::TimedOut)?
    }
}

impl Connection {
    /// The negotiated TLS version, `None` on plain TCP.
    #[must_use]
    pub fn tls_version(&self) -> Option<&'static str> {
        match self {
            Connection::Plain(_) => None,
            Connection::Tls(tls) => tls
                .get_ref()
                .1
                .protocol_version()
                .and_then(iop_shell_common::tls::version_name),
        }
    }
}

fn tls_failure(err: &std::io::Error) -> Failure {
    use std::io::ErrorKind;
    match err.kind() {
        ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted => {
            Failure::Tls(format!(
                "the edge closed the connection during the TLS handshake ({err}); is its node \
                 listener plaintext (listen.nodes_plaintext), or does it require a client \
                 certificate (edge_tls.cert_file)?"
            ))
        }
        _ => Failure::Tls(format!("handshake failed: {err}")),
    }
}

/// Accepts exactly the Edge certificate whose SHA-256 digest is pinned, and checks that
/// the Edge holds its key (the handshake signature), with rustls's own verification.
/// Names and dates are not checked: the pin is the trust decision, which is what makes a
/// self-signed Edge certificate usable.
#[derive(Debug)]
struct Pinned {
    digest: [u8; 32],
    algorithms: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for Pinned {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let presented = iop_proto_core::token::sha256(end_entity);
        if bool::from(presented.ct_eq(&self.digest)) {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::General(format!(
                "the edge's certificate has SHA-256 fingerprint {}, not the pinned {}",
                iop_shell_common::tls::fingerprint(end_entity),
                self.digest
                    .iter()
                    .map(|b| format!("{b:02X}"))
                    .collect::<Vec<_>>()
                    .join(":")
            )))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}
