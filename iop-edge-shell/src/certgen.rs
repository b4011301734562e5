//! `iop-edge gen-cert`: certificates for the node link without reaching for openssl.
//!
//! - self-signed (the default): a certificate for the Edge whose SHA-256 fingerprint
//!   Nodes pin (`edge_cert_sha256`);
//! - `--ca`: a certificate authority, to issue Edge and Node certificates from;
//! - `--ca-cert`/`--ca-key`: a certificate issued by that CA, for the Edge (Nodes trust
//!   the CA with `[edge_tls] ca_file`) or for a Node's client certificate under mutual
//!   TLS (name it after the node id: the Edge only lets it register that id).
//!
//! Keys are ECDSA P-256 (rcgen with ring). The key file is written with mode 0600 and
//! never overwritten unless `--force` is given.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// What to generate.
#[derive(Debug, Clone)]
pub struct Request {
    /// Names the certificate vouches for: DNS names or IP addresses; the first is also
    /// the subject common name.
    pub names: Vec<String>,
    /// Where to write the certificate (PEM).
    pub cert: PathBuf,
    /// Where to write the private key (PEM).
    pub key: PathBuf,
    /// Validity from now, in days.
    pub days: u32,
    /// Make a certificate authority instead of a leaf.
    pub ca: bool,
    /// Issue with this CA (certificate and key, PEM) instead of self-signing.
    pub issuer: Option<(PathBuf, PathBuf)>,
    /// Overwrite existing files.
    pub force: bool,
}

/// What was written.
#[derive(Debug, Clone)]
pub struct Generated {
    /// SHA-256 fingerprint of the certificate.
    pub fingerprint: String,
}

/// Generates and writes the certificate and key of `request`.
pub fn generate(request: &Request) -> Result<Generated, String> {
    if request.names.is_empty() {
        return Err("give at least one --name (a DNS name or an IP address)".into());
    }
    for path in [&request.cert, &request.key] {
        if path.exists() && !request.force {
            return Err(format!(
                "{} exists; pass --force to replace it",
                path.display()
            ));
        }
    }
    let mut params = CertificateParams::new(request.names.clone())
        .map_err(|err| format!("invalid --name: {err}"))?;
    params
        .distinguished_name
        .push(DnType::CommonName, request.names[0].clone());
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::hours(1);
    params.not_after = now + time::Duration::days(i64::from(request.days.max(1)));
    if request.ca {
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
    } else {
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
    }
    let key = KeyPair::generate().map_err(|err| format!("key generation failed: {err}"))?;
    let cert = match &request.issuer {
        None => params
            .self_signed(&key)
            .map_err(|err| format!("signing failed: {err}"))?,
        Some((ca_cert, ca_key)) => {
            let ca_key_pem = read(ca_key)?;
            let ca_key = KeyPair::from_pem(&ca_key_pem)
                .map_err(|err| format!("{}: not a usable key: {err}", ca_key.display()))?;
            let issuer = Issuer::from_ca_cert_pem(&read(ca_cert)?, ca_key)
                .map_err(|err| format!("{}: not a usable CA: {err}", ca_cert.display()))?;
            params
                .signed_by(&key, &issuer)
                .map_err(|err| format!("signing failed: {err}"))?
        }
    };
    write(&request.cert, cert.pem().as_bytes(), 0o644)?;
    write(&request.key, key.serialize_pem().as_bytes(), 0o600)?;
    Ok(Generated {
        fingerprint: iop_shell_common::tls::fingerprint(cert.der()),
    })
}

fn read(path: &Path) -> Result<String, String> {
    iop_shell_common::config::read_text(path)
        .map_err(|err| format!("cannot read {}: {err}", path.display()))
}

fn write(path: &Path, bytes: &[u8], mode: u32) -> Result<(), String> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let _ = std::fs::remove_file(path);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .map_err(|err| format!("cannot write {}: {err}", path.display()))?;
    file.write_all(bytes)
        .map_err(|err| format!("cannot write {}: {err}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("iop-certgen-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        dir
    }

    #[test]
    fn a_self_signed_pair_loads_as_a_server_config_and_its_fingerprint_matches() {
        let d = dir("self");
        let request = Request {
            names: vec!["localhost".into(), "127.0.0.1".into()],
            cert: d.join("cert.pem"),
            key: d.join("key.pem"),
            days: 30,
            ca: false,
            issuer: None,
            force: false,
        };
        let made = generate(&request).expect("generated");
        let certs =
            iop_shell_common::tls::read_certs("cert", &request.cert).expect("readable cert");
        assert_eq!(
            iop_shell_common::tls::fingerprint(&certs[0]),
            made.fingerprint
        );
        assert_eq!(
            iop_shell_common::tls::names(&certs[0]),
            vec!["localhost".to_owned()]
        );
        let files = iop_shell_common::tls::ServerFiles {
            cert_file: request.cert.clone(),
            key_file: request.key.clone(),
            client_ca_file: None,
        };
        iop_shell_common::tls::server_config("listen.nodes_tls", &files, &[]).expect("usable");
        let mode = std::fs::metadata(&request.key)
            .map(|m| std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o777)
            .expect("key file");
        assert_eq!(mode, 0o600);
        assert!(generate(&request).expect_err("exists").contains("--force"));
        let _ = std::fs::remove_dir_all(d);
    }

    #[test]
    fn an_expired_certificate_is_a_keyed_config_error() {
        let d = dir("expired");
        let key = KeyPair::generate().expect("key");
        let mut params = CertificateParams::new(vec!["localhost".to_owned()]).expect("params");
        params.not_before = rcgen::date_time_ymd(2020, 1, 1);
        params.not_after = rcgen::date_time_ymd(2021, 1, 1);
        let cert = params.self_signed(&key).expect("cert");
        write(&d.join("cert.pem"), cert.pem().as_bytes(), 0o644).expect("cert");
        write(&d.join("key.pem"), key.serialize_pem().as_bytes(), 0o600).expect("key");
        let files = iop_shell_common::tls::ServerFiles {
            cert_file: d.join("cert.pem"),
            key_file: d.join("key.pem"),
            client_ca_file: None,
        };
        let err = iop_shell_common::tls::server_config("listen.nodes_tls", &files, &[])
            .expect_err("expired")
            .to_string();
        assert!(err.starts_with("listen.nodes_tls.cert_file: "), "{err}");
        assert!(err.contains("expired"), "{err}");
        let _ = std::fs::remove_dir_all(d);
    }

    #[test]
    fn a_ca_issues_node_certificates_that_name_the_node() {
        let d = dir("ca");
        let ca = Request {
            names: vec!["iop-ca".into()],
            cert: d.join("ca.pem"),
            key: d.join("ca-key.pem"),
            days: 30,
            ca: true,
            issuer: None,
            force: false,
        };
        generate(&ca).expect("ca");
        let node = Request {
            names: vec!["gpu-box-1".into()],
            cert: d.join("node.pem"),
            key: d.join("node-key.pem"),
            days: 30,
            ca: false,
            issuer: Some((ca.cert.clone(), ca.key.clone())),
            force: false,
        };
        generate(&node).expect("node cert");
        let certs = iop_shell_common::tls::read_certs("cert", &node.cert).expect("readable");
        assert_eq!(
            iop_shell_common::tls::names(&certs[0]),
            vec!["gpu-box-1".to_owned()]
        );
        // A key that does not fit its certificate is named as such.
        let files = iop_shell_common::tls::ServerFiles {
            cert_file: node.cert.clone(),
            key_file: ca.key.clone(),
            client_ca_file: Some(ca.cert.clone()),
        };
        let err = iop_shell_common::tls::server_config("listen.nodes_tls", &files, &[])
            .expect_err("mismatched key")
            .to_string();
        assert!(err.contains("listen.nodes_tls.key_file"), "{err}");
        let _ = std::fs::remove_dir_all(d);
    }
}
