//! `[tracing]`: where the Edge exports its spans (OTLP), or the standard
//! `OTEL_EXPORTER_OTLP_*` environment when the file names no endpoint.

use iop_shell_common::config::{ConfigError, invalid};
use serde::Deserialize;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTracing {
    pub(super) otlp_endpoint: Option<String>,
    pub(super) protocol: Option<String>,
    pub(super) service_name: Option<String>,
    pub(super) sample_ratio: Option<f64>,
    #[serde(default)]
    pub(super) headers: std::collections::BTreeMap<String, String>,
}

/// Where the Edge exports its spans (`[tracing]`, or the standard `OTEL_EXPORTER_OTLP_*`
/// environment variables when the file names no endpoint). Read at start only.
#[derive(Clone, PartialEq)]
pub struct TraceExport {
    /// The collector's traces URL (`http://` or `https://`, path included).
    pub endpoint: http::Uri,
    /// Protobuf (`http/protobuf`, the default) or JSON (`http/json`).
    pub json: bool,
    /// `service.name` of the spans.
    pub service_name: String,
    /// Headers sent with every export (a collector's API key: kept out of logs).
    pub headers: Vec<(String, String)>,
    /// The share of traces the Edge starts that it records (0 to 1); a caller's own
    /// sampling decision is always kept.
    pub sample_ratio: f64,
}

// The headers may hold a collector's API key: only their names are shown.
impl std::fmt::Debug for TraceExport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TraceExport")
            .field("endpoint", &self.endpoint)
            .field("json", &self.json)
            .field("service_name", &self.service_name)
            .field(
                "headers",
                &self
                    .headers
                    .iter()
                    .map(|(name, _)| name)
                    .collect::<Vec<_>>(),
            )
            .field("sample_ratio", &self.sample_ratio)
            .finish()
    }
}

impl TraceExport {
    /// The export `[tracing]` describes, else the one the environment (`get`) describes:
    /// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (the full URL), or
    /// `OTEL_EXPORTER_OTLP_ENDPOINT` (a base, `/v1/traces` added), with
    /// `OTEL_EXPORTER_OTLP_PROTOCOL`, `OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_SERVICE_NAME`
    /// and the ratio of `OTEL_TRACES_SAMPLER=traceidratio` (or
    /// `parentbased_traceidratio`) in `OTEL_TRACES_SAMPLER_ARG`; none when neither names an endpoint (or `OTEL_SDK_DISABLED`
    /// is `true`).
    pub(super) fn resolve(
        raw: RawTracing,
        get: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<Self>, ConfigError> {
        let env = |name: &str| get(name).filter(|v| !v.trim().is_empty());
        let from_file = raw.otlp_endpoint.is_some();
        let endpoint = match raw.otlp_endpoint {
            Some(e) if e.is_empty() => return Ok(None),
            Some(e) => e,
            None if env("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) => {
                return Ok(None);
            }
            None => match (
                env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
                env("OTEL_EXPORTER_OTLP_ENDPOINT"),
            ) {
                (Some(full), _) => full,
                (None, Some(base)) => format!("{}/v1/traces", base.trim_end_matches('/')),
                (None, None) => return Ok(None),
            },
        };
        let key = |name: &'static str, var: &'static str| {
            if from_file {
                name.to_owned()
            } else {
                var.to_owned()
            }
        };
        let uri: http::Uri = endpoint.trim().parse().map_err(|_| {
            invalid(
                key("tracing.otlp_endpoint", "OTEL_EXPORTER_OTLP_ENDPOINT"),
                "must be a URL such as http://127.0.0.1:4318/v1/traces",
            )
        })?;
        // Logged at start: credentials belong in the headers, never in the URL.
        if uri.authority().is_some_and(|a| a.as_str().contains('@')) {
            return Err(invalid(
                key("tracing.otlp_endpoint", "OTEL_EXPORTER_OTLP_ENDPOINT"),
                "must not carry credentials (user:password@); put them in tracing.headers",
            ));
        }
        if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.host().is_none() {
            return Err(invalid(
                key("tracing.otlp_endpoint", "OTEL_EXPORTER_OTLP_ENDPOINT"),
                "must be an http:// or https:// URL with a host",
            ));
        }
        let protocol = raw
            .protocol
            .or_else(|| {
                (!from_file)
                    .then(|| env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"))
                    .flatten()
            })
            .or_else(|| {
                (!from_file)
                    .then(|| env("OTEL_EXPORTER_OTLP_PROTOCOL"))
                    .flatten()
            });
        let json = match protocol.as_deref().map(str::trim) {
            None | Some("http/protobuf") => false,
            Some("http/json") => true,
            Some(other) => {
                return Err(invalid(
                    key("tracing.protocol", "OTEL_EXPORTER_OTLP_PROTOCOL"),
                    format!(
                        "must be \"http/protobuf\" or \"http/json\" (gRPC is not spoken), got {other:?}"
                    ),
                ));
            }
        };
        let mut headers: Vec<(String, String)> = raw.headers.into_iter().collect();
        if !from_file && let Some(list) = env("OTEL_EXPORTER_OTLP_HEADERS") {
            for pair in list.split(',') {
                if let Some((k, v)) = pair.split_once('=') {
                    headers.push((k.trim().to_owned(), v.trim().to_owned()));
                }
            }
        }
        for (name, value) in &headers {
            if http::HeaderName::from_bytes(name.as_bytes()).is_err()
                || http::HeaderValue::from_str(value).is_err()
            {
                return Err(invalid(
                    key("tracing.headers", "OTEL_EXPORTER_OTLP_HEADERS"),
                    format!("{name:?} is not a valid header"),
                ));
            }
        }
        let ratio_from_env = || {
            env("OTEL_TRACES_SAMPLER")
                .filter(|s| s.ends_with("traceidratio"))
                .and_then(|_| env("OTEL_TRACES_SAMPLER_ARG"))
                .and_then(|arg| arg.trim().parse::<f64>().ok())
        };
        let sample_ratio = raw
            .sample_ratio
            .or_else(|| (!from_file).then(ratio_from_env).flatten())
            .unwrap_or(1.0);
        if !(0.0..=1.0).contains(&sample_ratio) {
            return Err(invalid(
                key("tracing.sample_ratio", "OTEL_TRACES_SAMPLER_ARG"),
                "must be between 0 and 1",
            ));
        }
        let service_name = raw
            .service_name
            .or_else(|| env("OTEL_SERVICE_NAME"))
            .unwrap_or_else(|| "iop-edge".to_owned());
        Ok(Some(TraceExport {
            endpoint: uri,
            json,
            service_name,
            headers,
            sample_ratio,
        }))
    }
}
