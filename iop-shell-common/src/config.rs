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

/// The most bytes a configuration file, or a file it names (a token, a certificate, a
/// key), may hold: far above any real one, so that a path to something else (a device,
/// a log) is refused instead of read whole into memory.
pub const MAX_FILE_BYTES: u64 = 1 << 20;

/// The bytes of the file at `path`; one of more than [`MAX_FILE_BYTES`] is an error
/// (`FileTooLarge`), found without reading past the limit.
pub fn read_file(path: &Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut bytes = Vec::new();
    std::fs::File::open(path)?
        .take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(std::io::Error::new(
            std::io::ErrorKind::FileTooLarge,
            format!("larger than {MAX_FILE_BYTES} bytes"),
        ));
    }
    Ok(bytes)
}

/// The text of the file at `path`, read as [`read_file`] does; text that is not UTF-8
/// is an error (`InvalidData`).
pub fn read_text(path: &Path) -> std::io::Result<String> {
    String::from_utf8(read_file(path)?)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "not UTF-8 text"))
}

/// The text of the configuration file at `path` ([`read_text`]).
pub fn read(path: &Path) -> Result<String, ConfigError> {
    read_text(path).map_err(|source| ConfigError::Io {
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
    fn a_file_past_the_limit_or_not_text_is_refused_without_reading_it_whole() {
        let dir = std::env::temp_dir().join(format!("iop-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let at_limit = dir.join("at-limit.toml");
        std::fs::write(&at_limit, vec![b'#'; MAX_FILE_BYTES as usize]).unwrap();
        assert_eq!(read(&at_limit).unwrap().len() as u64, MAX_FILE_BYTES);
        let over = dir.join("over.toml");
        std::fs::write(&over, vec![b'#'; MAX_FILE_BYTES as usize + 1]).unwrap();
        let err = read(&over).expect_err("over the limit");
        assert!(
            matches!(&err, ConfigError::Io { source, .. } if source.kind() == std::io::ErrorKind::FileTooLarge),
            "{err}"
        );
        assert!(err.to_string().contains("over.toml"), "{err}");
        // A device that never ends.
        let err = read_file(Path::new("/dev/zero")).expect_err("endless");
        assert_eq!(err.kind(), std::io::ErrorKind::FileTooLarge);
        let binary = dir.join("binary.toml");
        std::fs::write(&binary, [0xff, 0xfe]).unwrap();
        let err = read_text(&binary).expect_err("not UTF-8");
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidData);
        std::fs::remove_dir_all(&dir).unwrap();
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
