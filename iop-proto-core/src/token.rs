//! Credentials: a verifier that checks a presented secret (a node token, an API key)
//! against the SHA-256 digest of the configured one, in constant time.
//!
//! Only the digest is kept, so a verifier never holds the secret itself; a configuration
//! may give the digest directly (`sha256:<64 hex digits>`) and then never contains the
//! secret at all. Hashing and comparison come from RustCrypto's `sha2` and `subtle`.

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// Checks presented secrets against one configured secret.
#[derive(Clone, PartialEq, Eq)]
pub struct TokenVerifier {
    digest: [u8; 32],
}

impl std::fmt::Debug for TokenVerifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print a secret or its digest.
        f.write_str("TokenVerifier(<redacted>)")
    }
}

/// Why a configured secret cannot be used.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SecretError {
    /// Empty, or only whitespace.
    #[error("must not be empty or whitespace")]
    Empty,
    /// Leading or trailing whitespace, which a header or a file read would lose.
    #[error("must not start or end with whitespace")]
    Padded,
    /// A `sha256:` value that is not 64 hexadecimal digits.
    #[error("a sha256: digest must be 64 hexadecimal digits")]
    BadDigest,
}

impl TokenVerifier {
    /// A verifier for `secret`; only its digest is kept.
    #[must_use]
    pub fn from_secret(secret: &[u8]) -> Self {
        TokenVerifier {
            digest: sha256(secret),
        }
    }

    /// A verifier for the secret whose SHA-256 digest is written as 64 hexadecimal
    /// digits (either case).
    #[must_use]
    pub fn from_sha256_hex(hex: &str) -> Option<Self> {
        let bytes = hex.as_bytes();
        if bytes.len() != 64 {
            return None;
        }
        let mut digest = [0u8; 32];
        for (i, pair) in bytes.chunks_exact(2).enumerate() {
            let hi = char::from(pair[0]).to_digit(16)?;
            let lo = char::from(pair[1]).to_digit(16)?;
            digest[i] = u8::try_from(hi * 16 + lo).ok()?;
        }
        Some(TokenVerifier { digest })
    }

    /// Parses a configured key: `sha256:<64 hex digits>` is a digest, anything else is
    /// the secret itself. Empty, whitespace-only or whitespace-padded secrets are refused,
    /// since no client could present them.
    pub fn parse_key(value: &str) -> Result<Self, SecretError> {
        if value.trim().is_empty() {
            return Err(SecretError::Empty);
        }
        if let Some(hex) = value.strip_prefix("sha256:") {
            return Self::from_sha256_hex(hex).ok_or(SecretError::BadDigest);
        }
        if value.trim() != value {
            return Err(SecretError::Padded);
        }
        Ok(Self::from_secret(value.as_bytes()))
    }

    /// True when `presented` is the configured secret. Digests are compared, in constant
    /// time, so neither the length nor the content of the secret leaks through timing.
    #[must_use]
    pub fn verify(&self, presented: &[u8]) -> bool {
        bool::from(self.digest.ct_eq(&sha256(presented)))
    }

    /// The index of the verifier in `verifiers` that accepts `presented`. Every verifier
    /// is checked, so the time taken does not say which one matched.
    #[must_use]
    pub fn find(verifiers: &[TokenVerifier], presented: &[u8]) -> Option<usize> {
        Self::find_digest(verifiers.iter(), &sha256(presented))
    }

    /// [`find`](Self::find) for a secret already hashed (`digest` is its [`sha256`]), over
    /// any list of verifiers: one hash for every list a presented key is looked up in.
    #[must_use]
    pub fn find_digest<'a>(
        verifiers: impl IntoIterator<Item = &'a TokenVerifier>,
        digest: &[u8; 32],
    ) -> Option<usize> {
        let mut found = None;
        for (i, verifier) in verifiers.into_iter().enumerate() {
            if bool::from(verifier.digest.ct_eq(digest)) {
                found = Some(i);
            }
        }
        found
    }
}

/// SHA-256 (FIPS 180-4) of `data`.
#[must_use]
pub fn sha256(data: &[u8]) -> [u8; 32] {
    Sha256::digest(data).into()
}

/// `data`'s SHA-256 written as lowercase hexadecimal.
#[must_use]
pub fn sha256_hex(data: &[u8]) -> String {
    use std::fmt::Write;
    sha256(data).iter().fold(String::new(), |mut out, b| {
        let _ = write!(out, "{b:02x}");
        out
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha256_matches_the_fips_vectors() {
        assert_eq!(
            sha256_hex(b""),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(
            sha256_hex(b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"
        );
        assert_eq!(
            sha256_hex(&[b'a'; 1_000_000]),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"
        );
    }

    #[test]
    fn verifier_accepts_only_the_token() {
        let plain = TokenVerifier::from_secret(b"s3cret");
        assert!(plain.verify(b"s3cret"));
        assert!(!plain.verify(b"s3cre"));
        assert!(!plain.verify(b"s3cretx"));
        assert!(!plain.verify(b""));
        let digest = TokenVerifier::from_sha256_hex(&sha256_hex(b"s3cret")).expect("hex");
        assert_eq!(digest, plain);
        assert!(digest.verify(b"s3cret"));
        assert!(!digest.verify(b"S3cret"));
        assert!(TokenVerifier::from_sha256_hex("zz").is_none());
        assert!(!format!("{plain:?}").contains("s3cret"));
    }

    #[test]
    fn configured_keys_are_secrets_or_digests_and_never_blank() {
        let hashed = format!("sha256:{}", sha256_hex(b"sk-real"));
        assert!(
            TokenVerifier::parse_key(&hashed)
                .expect("digest")
                .verify(b"sk-real")
        );
        assert!(
            TokenVerifier::parse_key("sk-real")
                .expect("plain")
                .verify(b"sk-real")
        );
        assert_eq!(TokenVerifier::parse_key(""), Err(SecretError::Empty));
        assert_eq!(TokenVerifier::parse_key(" \t"), Err(SecretError::Empty));
        assert_eq!(TokenVerifier::parse_key(" sk"), Err(SecretError::Padded));
        assert_eq!(
            TokenVerifier::parse_key("sha256:12"),
            Err(SecretError::BadDigest)
        );
    }

    #[test]
    fn find_names_the_matching_key() {
        let keys = [
            TokenVerifier::from_secret(b"a-key"),
            TokenVerifier::from_secret(b"b-key"),
        ];
        assert_eq!(TokenVerifier::find(&keys, b"b-key"), Some(1));
        assert_eq!(TokenVerifier::find(&keys, b"c-key"), None);
        assert_eq!(TokenVerifier::find(&[], b"a-key"), None);
    }
}
