//! Provider adapters. The session decides what runs where; an adapter only turns a
//! `RunRequest` or `ProviderTunnelRequest` into HTTP calls and reports progress through a
//! [`Sink`]. Cancellation arrives through a `Cancel`; an adapter then aborts the
//! upstream request and still ends with a terminal output.

pub mod connector;
pub mod h1;
pub mod http;
/// Request bodies read without a document tree.
pub(crate) use iop_json as json;
pub mod mock;
pub mod mock_openai;
pub mod ollama;
pub mod openai;
pub mod pool;
pub mod sse;

use foldhash::{HashMap, HashMapExt};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use iop_proto_core::wire::{
    AdapterConfig, AdapterType, ErrorDetail, Header, NodeCommandRequest, NodeCommandResponse,
    NodeCommandType, NodeConfigPayload, ProviderHealth, RunRequest, TunnelRequest, Usage,
};
use iop_proto_core::{RunOutput, TunnelOutput};
use iop_shell_common::cancel::Cancel;
use tokio::sync::mpsc;

pub use self::http::HttpClient;

/// Progress from an adapter task to the connection driver.
#[derive(Debug)]
pub enum Output {
    /// A run's progress.
    Run {
        /// The run.
        run_id: Arc<str>,
        /// What happened.
        output: RunOutput,
    },
    /// A tunnel's progress.
    Tunnel {
        /// The tunnel.
        run_id: Arc<str>,
        /// What happened.
        output: TunnelOutput,
    },
    /// The adapter task returned (the session ends the work if no terminal was reported).
    Finished {
        /// The run or tunnel.
        run_id: Arc<str>,
        /// The outputs a tunnel ended with, reported with its return rather than one
        /// message each.
        tail: Option<TunnelTail>,
    },
    /// The answer to a command.
    Command(NodeCommandResponse),
}

/// The outputs a tunnel's work ends with, handed back when it returns: its status when
/// the whole answer was ready behind it, its last body bytes, the usage it observed, then
/// its end. A small answer reaches the session with the task's return in one message
/// instead of five.
#[derive(Debug, Default)]
pub struct TunnelTail {
    /// The status and response headers, not yet reported.
    pub status: Option<(u32, Vec<Header>)>,
    /// The last body bytes, not yet reported.
    pub body: Option<Bytes>,
    /// The usage observed in the response.
    pub usage: Option<Usage>,
}

impl TunnelTail {
    /// The outputs it stands for, in order: the status, the body bytes, the usage, the end.
    pub fn outputs(self) -> impl Iterator<Item = TunnelOutput> {
        let status = self
            .status
            .map(|(status, headers)| TunnelOutput::Status { status, headers });
        let body = self.body.map(TunnelOutput::Body);
        let usage = self.usage.map(TunnelOutput::Usage);
        status
            .into_iter()
            .chain(body)
            .chain(usage)
            .chain(std::iter::once(TunnelOutput::End))
    }
}

/// Where an adapter task reports progress.
#[derive(Clone, Debug)]
pub struct Sink {
    run_id: Arc<str>,
    tx: mpsc::Sender<Output>,
}

impl Sink {
    /// A sink for `run_id`.
    #[must_use]
    pub fn new(run_id: Arc<str>, tx: mpsc::Sender<Output>) -> Self {
        Sink { run_id, tx }
    }

    /// Reports run progress; false once the connection is gone.
    pub async fn run(&self, output: RunOutput) -> bool {
        self.tx
            .send(Output::Run {
                run_id: self.run_id.clone(),
                output,
            })
            .await
            .is_ok()
    }

    /// Reports tunnel progress; false once the connection is gone.
    pub async fn tunnel(&self, output: TunnelOutput) -> bool {
        self.tx
            .send(Output::Tunnel {
                run_id: self.run_id.clone(),
                output,
            })
            .await
            .is_ok()
    }
}

/// `work` on a run's input, off the Node's one thread when the input is large
/// ([`iop_shell_common::offload::run`]: converting a large input's JSON there would hold
/// every other stream's chunks back). What `work` made, or the run's terminal error:
/// `bad_request` with `work`'s reason for a refused input, a retryable `internal` one
/// when the conversion could not finish. Callers race it with the run's cancellation.
pub async fn convert_input<T, F>(input: &Bytes, work: F) -> Result<T, ErrorDetail>
where
    T: Send + 'static,
    F: FnOnce(&[u8]) -> Result<T, String> + Send + 'static,
{
    match iop_shell_common::offload::run(input, work).await {
        Ok(Ok(made)) => Ok(made),
        Ok(Err(refused)) => Err(error("bad_request", refused, false)),
        Err(_) => Err(error(
            "internal",
            "the run input could not be read: the node is stopping, or reading it failed",
            true,
        )),
    }
}

/// A stable error for a terminal event or frame.
#[must_use]
/// Whether a provider answering `status` failed in a way another provider may not: a
/// server error, too many requests or a request timeout (a caller's own 4xx is not).
pub(crate) fn provider_failed(status: ::http::StatusCode) -> bool {
    status.is_server_error()
        || status == ::http::StatusCode::TOO_MANY_REQUESTS
        || status == ::http::StatusCode::REQUEST_TIMEOUT
}

pub fn error(code: &str, message: impl Into<String>, retryable: bool) -> ErrorDetail {
    ErrorDetail {
        code: code.into(),
        message: message.into(),
        retryable,
    }
}

/// One configured adapter instance.
#[derive(Debug)]
pub enum Adapter {
    /// Built-in deterministic provider.
    Mock(mock::Mock),
    /// OpenAI-compatible server (also vLLM).
    OpenAi(openai::OpenAi),
    /// Ollama.
    Ollama(ollama::Ollama),
}

impl Adapter {
    /// Builds an adapter from its config, checking what the HTTP layer needs.
    pub fn build(
        config: &AdapterConfig,
        client: &HttpClient,
        default_timeout: Duration,
    ) -> Result<Self, String> {
        let kind =
            AdapterType::try_from(config.r#type).map_err(|_| "unknown adapter type".to_string())?;
        Ok(match kind {
            AdapterType::Mock => Adapter::Mock(mock::Mock::from_options(&config.options)?),
            AdapterType::OpenaiCompat | AdapterType::Vllm => Adapter::OpenAi(openai::OpenAi::new(
                config,
                client.clone(),
                default_timeout,
                kind == AdapterType::Vllm,
            )?),
            AdapterType::Ollama => Adapter::Ollama(ollama::Ollama::new(
                config,
                client.clone(),
                default_timeout,
            )?),
            AdapterType::Unspecified => return Err("adapter type is unspecified".into()),
        })
    }

    /// Executes a normalized run to its terminal output.
    pub async fn run(&self, request: RunRequest, sink: Sink, cancel: Cancel) {
        // Each adapter's future is boxed: inline, every run's task would reserve room for
        // the largest of them (the mock's, with its pacing timers, is twice the others).
        match self {
            Adapter::Mock(m) => iop_shell_common::in_box!(m.run(request, sink, cancel)).await,
            Adapter::OpenAi(o) => iop_shell_common::in_box!(o.run(request, sink, cancel)).await,
            Adapter::Ollama(o) => iop_shell_common::in_box!(o.run(request, sink, cancel)).await,
        }
    }

    /// Executes a raw tunnel to its terminal output: reported through `sink`, or the
    /// outputs it ends with handed back ([`TunnelTail`]).
    pub async fn tunnel(
        &self,
        request: TunnelRequest,
        sink: Sink,
        cancel: Cancel,
    ) -> Option<TunnelTail> {
        // The mock's future is boxed so that a provider's tunnel task is sized for its own.
        match self {
            Adapter::OpenAi(o) => o.tunnel(request, sink, cancel).await,
            Adapter::Mock(m) => {
                iop_shell_common::in_box!(m.tunnel(request, sink, cancel)).await;
                None
            }
            Adapter::Ollama(_) => {
                let _ = sink
                    .tunnel(TunnelOutput::Error(error(
                        "unsupported",
                        "this adapter serves normalized runs, not tunnels",
                        false,
                    )))
                    .await;
                None
            }
        }
    }
}

/// The adapters of the config in force, keyed by instance name. Cloning is cheap
/// (adapters are shared).
#[derive(Clone, Debug)]
pub struct AdapterHost {
    client: HttpClient,
    default_timeout: Duration,
    configs: HashMap<String, AdapterConfig>,
    adapters: HashMap<String, Arc<Adapter>>,
}

impl AdapterHost {
    /// An empty host.
    #[must_use]
    pub fn new(client: HttpClient, default_timeout: Duration) -> Self {
        AdapterHost {
            client,
            default_timeout,
            configs: HashMap::new(),
            adapters: HashMap::new(),
        }
    }

    /// Replaces the adapter set with `payload`'s enabled adapters. All are built before
    /// any is swapped in, so a failure leaves the previous set running. Unchanged
    /// adapters keep their instance (and its connection pool).
    pub fn apply(&mut self, payload: &NodeConfigPayload) -> Result<(), String> {
        let mut adapters = HashMap::new();
        let mut configs = HashMap::new();
        for config in payload.adapters.iter().filter(|a| a.enabled) {
            let name = config.instance_name().to_owned();
            let adapter = match (self.configs.get(&name), self.adapters.get(&name)) {
                (Some(old), Some(existing)) if old == config => existing.clone(),
                _ => Arc::new(
                    Adapter::build(config, &self.client, self.default_timeout)
                        .map_err(|err| format!("adapter {name:?}: {err}"))?,
                ),
            };
            adapters.insert(name.clone(), adapter);
            configs.insert(name, config.clone());
        }
        self.adapters = adapters;
        self.configs = configs;
        Ok(())
    }

    /// The adapter named `name`.
    #[must_use]
    pub fn get(&self, name: &str) -> Option<Arc<Adapter>> {
        self.adapters.get(name).cloned()
    }

    /// Answers a validated command. `transport` is the `TRANSPORT_STATUS` payload.
    pub async fn command(
        &self,
        request: NodeCommandRequest,
        transport: serde_json::Value,
    ) -> NodeCommandResponse {
        let reply = |result: Result<Bytes, String>| match result {
            Ok(payload) => NodeCommandResponse {
                request_id: request.request_id.clone(),
                ok: true,
                error: String::new(),
                payload,
            },
            Err(error) => NodeCommandResponse {
                request_id: request.request_id.clone(),
                ok: false,
                error,
                payload: Bytes::new(),
            },
        };
        match NodeCommandType::try_from(request.r#type) {
            Ok(NodeCommandType::Capabilities) => reply(Ok(self.capabilities().await)),
            Ok(NodeCommandType::TransportStatus) => reply(Ok(Bytes::from(transport.to_string()))),
            Ok(NodeCommandType::OllamaApi) => {
                match self.adapters.get(&request.adapter).map(|a| &**a) {
                    Some(Adapter::Ollama(ollama)) => reply(
                        ollama
                            .api(&request.method, &request.path, request.body.clone())
                            .await,
                    ),
                    Some(_) => reply(Err(format!(
                        "adapter {:?} is not an ollama adapter",
                        request.adapter
                    ))),
                    None => reply(Err(format!("no adapter named {:?}", request.adapter))),
                }
            }
            _ => reply(Err("command type not admitted".into())),
        }
    }

    async fn capabilities(&self) -> Bytes {
        let mut names: Vec<&String> = self.configs.keys().collect();
        names.sort();
        // Every provider is probed at once: dead ones cost one probe timeout in all, not
        // one each, so the answer stays inside the Edge's command timeout.
        let mut probes = tokio::task::JoinSet::new();
        for name in &names {
            let (name, adapter) = ((*name).clone(), self.adapters.get(*name).cloned());
            probes.spawn(async move {
                let health = match adapter.as_deref() {
                    Some(Adapter::OpenAi(o)) => o.health().await,
                    Some(Adapter::Ollama(o)) => o.health().await,
                    Some(Adapter::Mock(_)) => ProviderHealth::Healthy,
                    None => ProviderHealth::Offline,
                };
                (name, health)
            });
        }
        let mut healths = HashMap::new();
        while let Some(Ok((name, health))) = probes.join_next().await {
            healths.insert(name, health);
        }
        let mut adapters = Vec::new();
        for name in names {
            let config = &self.configs[name];
            let kind =
                AdapterType::try_from(config.r#type).map_or("unknown", AdapterType::config_name);
            // The words `/v1/status` uses for the same providers.
            let health = healths
                .get(name)
                .copied()
                .unwrap_or(ProviderHealth::Offline)
                .word();
            adapters.push(serde_json::json!({
                "name": name,
                "type": kind,
                "targets": config.targets,
                "capacity": config.capacity,
                "long_capacity": config.long_capacity,
                "health": health,
            }));
        }
        Bytes::from(serde_json::json!({ "adapters": adapters }).to_string())
    }
}

/// What the adapters' tests share.
#[cfg(test)]
pub(crate) mod testing {
    use super::{Output, Sink};
    use iop_proto_core::RunOutput;
    use iop_proto_core::wire::RunRequest;
    use iop_shell_common::cancel::Cancel;
    use iop_shell_common::offload::{INLINE_MAX, slots};
    use std::time::Duration;

    /// The last run output of `run`, given a large input while every conversion slot is
    /// taken and cancelled once it waits; panics unless it ends within 10 s.
    pub(crate) async fn cancelled_waiting_for_a_slot<F, Fut>(run: F) -> Option<RunOutput>
    where
        F: FnOnce(RunRequest, Sink, Cancel) -> Fut,
        Fut: std::future::Future<Output = ()>,
    {
        let slots = slots();
        let _held = slots
            .acquire_many(u32::try_from(slots.available_permits()).expect("few"))
            .await
            .expect("slots");
        let (tx, mut rx) = tokio::sync::mpsc::channel(64);
        let cancel = Cancel::new();
        let request = RunRequest {
            run_id: "r1".into(),
            input: vec![b' '; INLINE_MAX].into(),
            ..RunRequest::default()
        };
        let running = run(request, Sink::new("r1".into(), tx), cancel.clone());
        let cancelling = async {
            tokio::task::yield_now().await;
            cancel.cancel();
        };
        tokio::time::timeout(Duration::from_secs(10), async {
            tokio::join!(running, cancelling)
        })
        .await
        .expect("the cancelled run ended without a slot");
        last_run_output(&mut rx)
    }

    /// The last run output queued on `rx`, once the run has returned.
    pub(crate) fn last_run_output(
        rx: &mut tokio::sync::mpsc::Receiver<Output>,
    ) -> Option<RunOutput> {
        let mut last = None;
        while let Ok(Output::Run { output, .. }) = rx.try_recv() {
            last = Some(output);
        }
        last
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "current_thread")]
    async fn a_large_run_input_is_read_off_the_thread_that_polls_the_streams() {
        use iop_shell_common::offload::INLINE_MAX;
        let here = std::thread::current().id();
        let small = Bytes::from(vec![b' '; INLINE_MAX - 1]);
        let large = Bytes::from(vec![b' '; INLINE_MAX]);
        let read = |input: &[u8]| Ok::<_, String>((std::thread::current().id(), input.len()));
        let inline = convert_input(&small, read).await.ok();
        assert_eq!(inline, Some((here, INLINE_MAX - 1)));
        let (there, read) = convert_input(&large, read).await.expect("converted");
        assert_ne!(there, here, "a large input was read on the streams' thread");
        assert_eq!(read, INLINE_MAX);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_conversion_that_panics_ends_in_an_error_not_in_a_panic() {
        let large = Bytes::from(vec![0; iop_shell_common::offload::INLINE_MAX]);
        let failed = convert_input(&large, |_| -> Result<u8, String> {
            panic!("a converter bug")
        })
        .await
        .expect_err("no conversion");
        assert!(failed.retryable);
        assert_eq!(failed.code, "internal");
        // A refused input is the caller's error, not retryable.
        let refused = convert_input(&large, |_| Err::<u8, _>("not JSON".to_owned()))
            .await
            .expect_err("refused");
        assert_eq!(
            (refused.code.as_str(), refused.retryable),
            ("bad_request", false)
        );
        assert_eq!(refused.message, "not JSON");
    }
}
