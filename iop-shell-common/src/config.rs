//! Reading a binary's TOML file: one error type naming the file or the key at fault.

use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;

/// A configuration that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Malformed TOML, or an unknown or mistyped key.
    #[error("{path}: {message}")]
    Parse {
        /// The path.
        path: PathBuf,
        /// The parser's message (names the key and line).
        message: String,
    },
    /// A key holds a value that cannot work.
    #[error("{key}: {problem}")]
    Invalid {
        /// The key.
        key: String,
        /// What is wrong.
        problem: String,
    },
}

/// [`ConfigError::Invalid`] for `key`.
pub fn invalid(key: impl Into<String>, problem: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        problem: problem.into(),
    }
}

/// The text of the file at `path`.
pub fn read(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
        path: path.to_owned(),
        source,
    })
}

/// `text`, read from `path`, as TOML shaped like `T` (whose `deny_unknown_fields`
/// refuses unknown keys).
pub fn parse_toml<T: DeserializeOwned>(text: &str, path: &Path) -> Result<T, ConfigError> {
    toml::from_str(text).map_err(|err| ConfigError::Parse {
        path: path.to_owned(),
        message: err.to_string().trim().to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Sample {
        #[allow(dead_code)]
        port: u16,
    }

    #[test]
    fn errors_name_the_file_the_key_and_the_problem() {
        let path = Path::new("/etc/iop/x.toml");
        let err = parse_toml::<Sample>("port = 1\nprot = 2\n", path).expect_err("unknown key");
        let text = err.to_string();
        assert!(text.starts_with("/etc/iop/x.toml: "), "{text}");
        assert!(text.contains("prot"), "{text}");
        let err = parse_toml::<Sample>("port = 70000\n", path).expect_err("out of range");
        assert!(matches!(err, ConfigError::Parse { .. }), "{err}");
        let err = read(Path::new("/nonexistent/iop.toml")).expect_err("missing file");
        assert!(
            err.to_string()
                .starts_with("cannot read /nonexistent/iop.toml: "),
            "{err}"
        );
        assert_eq!(
            invalid("queue.max_waiting", "must be positive").to_string(),
            "queue.max_waiting: must be positive"
        );
    }
}
