//! TLS material both shells read: PEM certificates and keys with errors that name the
//! config key and the problem, SHA-256 certificate fingerprints, the names a certificate
//! vouches for, and server configurations (rustls with the `ring` provider; no
//! cryptography here is our own).

use std::path::Path;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use crate::config::{ConfigError, invalid};

/// The one crypto provider both shells use: ring's, with AES-128-GCM/SHA-256 preferred
/// in TLS 1.3 (rustls's default puts AES-256-GCM/SHA-384 first). Both are TLS 1.3's
/// standard suites; the SHA-256 one's key schedule and transcript hash cost less per
/// handshake, which is what an Edge pays a thousand times over when its nodes redial.
#[must_use]
pub fn provider() -> Arc<CryptoProvider> {
    use rustls::crypto::ring::cipher_suite::TLS13_AES_128_GCM_SHA256;
    let mut provider = rustls::crypto::ring::default_provider();
    provider
        .cipher_suites
        .sort_by_key(|suite| suite.suite() != TLS13_AES_128_GCM_SHA256.suite());
    Arc::new(provider)
}

/// The certificates of a PEM file, in order (leaf first for a chain).
pub fn read_certs(key: &str, path: &Path) -> Result<Vec<CertificateDer<'static>>, ConfigError> {
    let pem_bytes = read_pem(key, path)?;
    let certs = CertificateDer::pem_slice_iter(&pem_bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|err| invalid(key, format!("{}: {}", path.display(), pem(&err))))?;
    if certs.is_empty() {
        return Err(invalid(
            key,
            format!("{}: no PEM certificate in it", path.display()),
        ));
    }
    Ok(certs)
}

/// The private key of a PEM file (PKCS#8, PKCS#1 or SEC1).
pub fn read_key(key: &str, path: &Path) -> Result<PrivateKeyDer<'static>, ConfigError> {
    let pem_bytes = read_pem(key, path)?;
    PrivateKeyDer::from_pem_slice(&pem_bytes).map_err(|err| {
        invalid(
            key,
            format!(
                "cannot read a private key from {}: {}",
                path.display(),
                pem(&err)
            ),
        )
    })
}

/// The bytes of a PEM file named by config `key`, no more than
/// [`crate::config::MAX_FILE_BYTES`].
fn read_pem(key: &str, path: &Path) -> Result<Vec<u8>, ConfigError> {
    crate::config::read_file(path)
        .map_err(|err| invalid(key, format!("cannot read {}: {err}", path.display())))
}

fn pem(err: &rustls_pki_types::pem::Error) -> String {
    match err {
        rustls_pki_types::pem::Error::Io(io) => io.to_string(),
        rustls_pki_types::pem::Error::NoItemsFound => "no PEM item of the expected kind".into(),
        other => format!("{other:?}"),
    }
}

/// The SHA-256 fingerprint of a DER certificate, as `openssl x509 -fingerprint -sha256`
/// prints it: upper-case hex pairs joined by colons.
#[must_use]
pub fn fingerprint(der: &[u8]) -> String {
    iop_proto_core::token::sha256(der)
        .iter()
        .map(|b| format!("{b:02X}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// Parses a fingerprint written as 64 hex digits, with or without colons or a
/// `sha256:` prefix, in either case.
#[must_use]
pub fn parse_fingerprint(text: &str) -> Option<[u8; 32]> {
    let text = text.trim();
    let text = text
        .strip_prefix("sha256:")
        .or_else(|| text.strip_prefix("SHA256:"))
        .unwrap_or(text);
    let hex: Vec<u8> = text.bytes().filter(|&b| b != b':').collect();
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, pair) in hex.chunks_exact(2).enumerate() {
        let hi = char::from(pair[0]).to_digit(16)?;
        let lo = char::from(pair[1]).to_digit(16)?;
        out[i] = u8::try_from(hi * 16 + lo).ok()?;
    }
    Some(out)
}

/// The names a certificate vouches for: its subject common names and its DNS subject
/// alternative names, in that order, without duplicates. Empty if it cannot be parsed.
#[must_use]
pub fn names(der: &[u8]) -> Vec<String> {
    use x509_parser::extensions::GeneralName;
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else {
        return Vec::new();
    };
    let mut out: Vec<String> = cert
        .subject()
        .iter_common_name()
        .filter_map(|cn| cn.as_str().ok().map(str::to_owned))
        .collect();
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for name in &san.value.general_names {
            if let GeneralName::DNSName(dns) = name
                && !out.iter().any(|n| n == dns)
            {
                out.push((*dns).to_owned());
            }
        }
    }
    out
}

/// Refuses a certificate that is expired or not yet valid at `now`.
pub fn check_validity(key: &str, der: &[u8], now: SystemTime) -> Result<(), ConfigError> {
    let (_, cert) = x509_parser::parse_x509_certificate(der)
        .map_err(|err| invalid(key, format!("not a valid X.509 certificate: {err}")))?;
    let now = now
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
    let validity = cert.validity();
    if now > validity.not_after.timestamp() {
        return Err(invalid(
            key,
            format!("the certificate expired on {}", validity.not_after),
        ));
    }
    if now < validity.not_before.timestamp() {
        return Err(invalid(
            key,
            format!(
                "the certificate is not valid before {}",
                validity.not_before
            ),
        ));
    }
    Ok(())
}

/// A TLS version as people write it (`TLSv1.3`).
#[must_use]
pub fn version_name(version: rustls::ProtocolVersion) -> Option<&'static str> {
    match version {
        rustls::ProtocolVersion::TLSv1_3 => Some("TLSv1.3"),
        rustls::ProtocolVersion::TLSv1_2 => Some("TLSv1.2"),
        _ => None,
    }
}

/// Where a listener's TLS material lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerFiles {
    /// The certificate chain (PEM, leaf first).
    pub cert_file: std::path::PathBuf,
    /// Its private key (PEM).
    pub key_file: std::path::PathBuf,
    /// When set, clients must present a certificate issued by one of these CAs (PEM).
    pub client_ca_file: Option<std::path::PathBuf>,
}

/// A server configuration for `files`, offering `alpn` (in preference order). `key` is
/// the config section named in errors (e.g. `listen.nodes_tls`). Fails, naming the key,
/// when a file is missing or unreadable, the key does not match the certificate, or the
/// certificate is expired or not yet valid.
pub fn server_config(
    key: &str,
    files: &ServerFiles,
    alpn: &[&[u8]],
) -> Result<Arc<ServerConfig>, ConfigError> {
    let cert_key = format!("{key}.cert_file");
    let certs = read_certs(&cert_key, &files.cert_file)?;
    check_validity(&cert_key, &certs[0], SystemTime::now())?;
    let private = read_key(&format!("{key}.key_file"), &files.key_file)?;
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|err| invalid(key, err.to_string()))?;
    let builder = match &files.client_ca_file {
        None => builder.with_no_client_auth(),
        Some(path) => {
            let ca_key = format!("{key}.client_ca_file");
            let mut roots = RootCertStore::empty();
            for cert in read_certs(&ca_key, path)? {
                roots
                    .add(cert)
                    .map_err(|err| invalid(&ca_key, format!("{}: {err}", path.display())))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                .build()
                .map_err(|err| invalid(&ca_key, err.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder.with_single_cert(certs, private).map_err(|err| {
        invalid(
            format!("{key}.key_file"),
            format!(
                "{} does not fit {}: {err}",
                files.key_file.display(),
                files.cert_file.display()
            ),
        )
    })?;
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    // The suite is the Edge's choice (see `provider`), whatever order a client lists.
    config.ignore_client_order = true;
    Ok(Arc::new(config))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handshakes_prefer_the_sha256_suite_and_keep_the_others() {
        use rustls::CipherSuite;
        let suites: Vec<CipherSuite> = provider().cipher_suites.iter().map(|s| s.suite()).collect();
        assert_eq!(suites[0], CipherSuite::TLS13_AES_128_GCM_SHA256);
        let default = rustls::crypto::ring::default_provider().cipher_suites;
        assert_eq!(suites.len(), default.len());
        assert!(suites.contains(&CipherSuite::TLS13_AES_256_GCM_SHA384));
    }

    #[test]
    fn pem_files_are_read_within_the_limit_and_errors_name_the_key() {
        let endless = Path::new("/dev/zero");
        let err = read_certs("listen.nodes_tls.cert", endless).expect_err("endless");
        let text = err.to_string();
        assert!(
            text.starts_with("listen.nodes_tls.cert: cannot read /dev/zero"),
            "{text}"
        );
        assert!(text.contains("larger than"), "{text}");
        let err = read_key("listen.nodes_tls.key", endless).expect_err("endless");
        assert!(err.to_string().contains("larger than"), "{err}");
        let missing = Path::new("/nonexistent/iop/cert.pem");
        let err = read_certs("tls.ca", missing).expect_err("missing");
        assert!(
            err.to_string()
                .starts_with("tls.ca: cannot read /nonexistent"),
            "{err}"
        );
        let empty = Path::new("/dev/null");
        let err = read_certs("tls.ca", empty).expect_err("no certificate");
        assert!(err.to_string().contains("no PEM certificate"), "{err}");
        let err = read_key("tls.key", empty).expect_err("no key");
        assert!(err.to_string().contains("no PEM item"), "{err}");
    }

    #[test]
    fn fingerprints_read_back_in_every_spelling() {
        let printed = fingerprint(b"certificate bytes");
        assert_eq!(printed.len(), 32 * 3 - 1);
        let digest = parse_fingerprint(&printed).expect("colon form");
        assert_eq!(parse_fingerprint(&printed.to_lowercase()), Some(digest));
        assert_eq!(
            parse_fingerprint(&format!("sha256:{}", printed.replace(':', ""))),
            Some(digest)
        );
        assert_eq!(parse_fingerprint("AB:CD"), None);
        assert_eq!(parse_fingerprint(&"zz".repeat(32)), None);
    }
}
