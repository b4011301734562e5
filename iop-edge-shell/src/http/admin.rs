//! The operator and catalogue routes: `/v1/models`, `/v1/status` and the node command
//! pass-through.

use bytes::Bytes;
use http::{Response, StatusCode};
use iop_api::openai::{ApiError, ErrorType};
use iop_proto_core::edge::NodeState;
use serde_json::{Value, json};
use tokio::sync::oneshot;

use super::{Caller, ResBody, State, api_error, error, json_response};
use crate::driver::{CoreMsg, Snapshot};

pub(super) async fn snapshot(state: &State) -> Option<Snapshot> {
    let (reply, rx) = oneshot::channel();
    state.core.send(CoreMsg::Snapshot { reply }).ok()?;
    rx.await.ok()
}

/// A model as both SDKs read it: OpenAI's `object`, `created`, `owned_by`, and the
/// Messages API's `type`, `display_name`, `created_at` (what Claude Code's model
/// discovery reads).
fn model_object(name: &str, settings: &crate::config::HttpSettings) -> Value {
    let display = settings.display_names.get(name).map_or(name, |d| &**d);
    json!({
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "iop",
        "type": "model",
        "display_name": display,
        "created_at": "1970-01-01T00:00:00Z",
    })
}

pub(super) async fn models(state: &State, caller: &Caller) -> Response<ResBody> {
    let Some(snapshot) = snapshot(state).await else {
        return api_error(&ApiError::shutting_down());
    };
    let settings = state.settings();
    let data: Vec<Value> = snapshot
        .queue_by_model
        .iter()
        .filter(|(name, _)| state.tenants.may_use(&caller.name, name))
        .map(|(name, _)| model_object(name, &settings))
        .collect();
    // The whole list is one page; the Messages API's paging fields say so.
    let first = data.first().map(|m| m["id"].clone());
    let last = data.last().map(|m| m["id"].clone());
    json_response(
        StatusCode::OK,
        Bytes::from(
            json!({
                "object": "list",
                "data": data,
                "has_more": false,
                "first_id": first,
                "last_id": last,
            })
            .to_string(),
        ),
    )
}

/// `GET /v1/models/{id}`: the model object, or OpenAI's 404 `model_not_found`. The id is
/// the rest of the path, percent-decoded (model names such as `llama3.1:8b` or
/// `org/model` reach it whole).
pub(super) async fn model(state: &State, caller: &Caller, id: &str) -> Response<ResBody> {
    let Some(snapshot) = snapshot(state).await else {
        return api_error(&ApiError::shutting_down());
    };
    let id = percent_decode(id);
    if snapshot.queue_by_model.iter().any(|(name, _)| *name == id)
        && state.tenants.may_use(&caller.name, &id)
    {
        let object = model_object(&id, &state.settings());
        return json_response(StatusCode::OK, Bytes::from(object.to_string()));
    }
    error(
        StatusCode::NOT_FOUND,
        &format!("The model `{id}` does not exist or you do not have access to it."),
        ErrorType::InvalidRequest,
        Some("model_not_found"),
    )
}

/// `%XX` escapes decoded; anything malformed is kept as it is.
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        if bytes[i] == b'%'
            && let (Some(hi), Some(lo)) = (
                bytes.get(i + 1).copied().and_then(hex),
                bytes.get(i + 2).copied().and_then(hex),
            )
        {
            out.push((hi * 16 + lo) as u8);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `LocalInference` → `local_inference`: the wire enum names, as configuration spells them.
fn enum_name<E: std::fmt::Debug, X>(value: Result<E, X>) -> String {
    let Ok(value) = value else {
        return "unknown".to_owned();
    };
    let mut out = String::new();
    for (i, c) in format!("{value:?}").chars().enumerate() {
        if c.is_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_lowercase());
    }
    out
}

pub(super) async fn status(state: &State) -> Response<ResBody> {
    use iop_proto_core::wire::{ProviderCategory, ProviderHealth, ProviderStatus};
    let Some(snapshot) = snapshot(state).await else {
        return api_error(&ApiError::shutting_down());
    };
    let nodes: Vec<Value> = snapshot
        .nodes
        .iter()
        .map(|n| {
            // A node id in conflict says so in its state; `connected` still tells
            // whether the connection holding it is ready.
            let state = if n.conflict {
                "conflict".to_owned()
            } else if n.draining {
                "draining".to_owned()
            } else {
                format!("{:?}", n.state).to_lowercase()
            };
            json!({
                "node_id": &*n.node_id,
                "state": state,
                "connected": n.state == NodeState::Ready,
                "conflict": n.conflict,
                "draining": n.draining,
                "tls": n.tls.is_some(),
                "tls_version": n.tls,
                "client_certificate": n.client_certificate,
                "generation": n.generation.map(|g| g.0),
                "config_revision": n.revision,
                "applied_revision": n.applied_revision,
                "last_refresh": n.last_refresh.map(|s| format!("{s:?}").to_lowercase()),
                "version": n.version,
                "labels": n.labels,
                // Millisecond resolution: the core's clock is in milliseconds.
                "heartbeat_rtt_ms": n.rtt.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
                "last_seen_ms": n.last_seen.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            })
        })
        .collect();
    let routing = |node: &str, provider: &str| -> Value {
        use iop_proto_core::edge::Standing;
        let Some(r) = snapshot
            .routing
            .iter()
            .find(|r| &*r.node_id == node && &*r.provider_id == provider)
        else {
            return Value::Null;
        };
        let (standing, reason) = match r.standing {
            Standing::Live => ("live", None),
            Standing::Ejected { reason, .. } => ("ejected", Some(reason.label())),
            Standing::ProbeDue => ("probe_due", None),
            Standing::Probing => ("probing", None),
        };
        json!({
            "standing": standing,
            "ejected": standing != "live",
            "ejected_for_ms": r.ejected_for.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            "reason": reason,
            "consecutive_failures": r.consecutive_failures,
            "failure_share": (r.failure_share * 1000.0).round() / 1000.0,
            "first_byte_ms": r.first_byte.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
        })
    };
    let routing_of = |p: &iop_proto_core::wire::ProviderSnapshot| {
        snapshot
            .routing
            .iter()
            .find(|r| *r.node_id == *p.node_id && *r.provider_id == *p.provider_id)
    };
    let providers: Vec<Value> = snapshot
        .providers
        .iter()
        .map(|p| {
            let routing = routing(&p.node_id, &p.provider_id);
            json!({
                "ejected": routing["ejected"].as_bool().unwrap_or(false),
                "routing": routing,
                "node_id": p.node_id,
                "provider_id": p.provider_id,
                "category": enum_name(ProviderCategory::try_from(p.category)),
                "status": enum_name(ProviderStatus::try_from(p.status)),
                "health": enum_name(ProviderHealth::try_from(p.health)),
                "capacity": p.capacity,
                "long_capacity": p.long_capacity,
                "in_flight": p.in_flight,
                "long_in_flight": p.long_in_flight,
                // Units a re-homed node's work for the previous Edge process (or another
                // Edge of a cluster) holds, and units held back since the node refused
                // work this Edge had counted free.
                "held_elsewhere": routing_of(p).map_or(0, |r| r.held_elsewhere),
                "refused_hold": routing_of(p).map_or(0, |r| r.refused_hold),
                "queued": p.queued,
                "long_queued": p.long_queued,
                "targets": p.targets,
            })
        })
        .collect();
    let queue: serde_json::Map<String, Value> = snapshot
        .queue_by_model
        .iter()
        .map(|(m, n)| (m.clone(), json!(n)))
        .collect();
    let ms = |d: std::time::Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    let failures = &snapshot.registration_failures;
    // Who keeps failing to register, so an operator finds the misconfigured machine: the
    // node ids claimed (`known`: a wrong token; otherwise a wrong id) and the addresses.
    let registrations = json!({
        "failing_node_ids": failures.nodes.iter().map(|f| json!({
            "node_id": f.node_id,
            "known": f.known,
            "failures": f.failures,
            "throttled": !f.hold.is_zero(),
            "hold_ms": ms(f.hold),
            "last_failure_ms_ago": ms(f.since_last),
        })).collect::<Vec<_>>(),
        "failing_sources": failures.sources.iter().map(|f| json!({
            "source": f.key.to_string(),
            "failures": f.failures,
            "throttled": !f.hold.is_zero(),
            "hold_ms": ms(f.hold),
            "last_failure_ms_ago": ms(f.since_last),
        })).collect::<Vec<_>>(),
    });
    let store = state.responses_figures();
    let body = json!({
        "nodes": nodes,
        "providers": providers,
        "queue": queue,
        "open_requests": snapshot.open_requests,
        "registrations": registrations,
        // In cluster mode: this Edge's id, whether it is a member, and every member.
        "cluster": state.cluster.as_ref().map(|c| c.snapshot()),
        // In cluster mode: keys are limited across the Edges, or, while etcd is
        // unreachable, each Edge keeps to its share of every limit (`detached`).
        "keys_across_cluster": state.cluster.as_ref().map(|_| json!({
            "detached": state.tenants.detached(),
            "sync_every_ms": crate::key_sync::SYNC_EVERY.as_millis() as u64,
            "etcd_writes": crate::key_sync::WRITES.load(std::sync::atomic::Ordering::Relaxed),
        })),
        // The stored responses `previous_response_id` continues from (this Edge's).
        "responses_store": {
            "entries": store.entries,
            "bytes": store.bytes,
            "evicted": store.evicted,
            "max_entries": store.max_entries,
            "max_bytes": store.max_bytes,
        },
        // Placing requests by their conversation: how many went where for which reason,
        // and what this Edge remembers of the prompts it sent (bounded by
        // `routing.prefix_entries`).
        "affinity": {
            "mode": snapshot.affinity_config.mode.as_str(),
            "load_factor": f64::from(snapshot.affinity_config.load_factor_percent) / 100.0,
            "placed": iop_proto_core::edge::Placed::ALL
                .iter()
                .zip(snapshot.affinity.placed)
                .map(|(why, n)| (why.as_str().to_owned(), json!(n)))
                .collect::<serde_json::Map<String, serde_json::Value>>(),
            "matched_blocks": snapshot.affinity.matched_blocks,
            "prefix_entries": snapshot.affinity.prefix_entries,
            "prefix_bytes": snapshot.affinity.prefix_bytes,
            "prefix_max_entries": snapshot.affinity_config.prefix_entries,
        },
    });
    json_response(StatusCode::OK, Bytes::from(body.to_string()))
}

/// `/v1/nodes/{node}/capabilities`, `/v1/nodes/{node}/transport` and the read-only
/// `/v1/nodes/{node}/ollama/{adapter}/api/...` pass-through: node commands.
pub(super) async fn node_command<B: super::ReqBody>(
    req: super::Req<B>,
    state: &State,
) -> Response<ResBody> {
    use iop_proto_core::wire::{NodeCommandRequest, NodeCommandType};
    let method = req.method().as_str().to_owned();
    let path = req.uri().path().to_owned();
    let rest = path.trim_start_matches("/v1/nodes/");
    let (node_id, what) = rest.split_once('/').unwrap_or((rest, ""));
    let mut request = NodeCommandRequest {
        method,
        ..NodeCommandRequest::default()
    };
    match what {
        "capabilities" => request.r#type = NodeCommandType::Capabilities as i32,
        "transport" => request.r#type = NodeCommandType::TransportStatus as i32,
        other => match other
            .strip_prefix("ollama/")
            .and_then(|r| r.split_once('/'))
        {
            Some((adapter, api)) => {
                request.r#type = NodeCommandType::OllamaApi as i32;
                request.adapter = adapter.to_owned();
                request.path = format!("/{api}");
            }
            None => {
                return error(
                    StatusCode::NOT_FOUND,
                    &format!("no route for {path}"),
                    ErrorType::InvalidRequest,
                    Some("unknown_url"),
                );
            }
        },
    }
    // Read as an inference request's body: within the size limit, the in-flight byte
    // budget (held until the node has answered) and the body deadline.
    let settings = state.settings();
    let content_length = super::inference::declared_length(req.headers());
    let memory = crate::memory::RequestMemory::new(state.budget.clone());
    let deadline = std::pin::pin!(tokio::time::sleep(settings.body_read_timeout));
    request.body = match super::inference::read_body(
        req.into_body(),
        content_length,
        &settings,
        &memory,
        deadline,
    )
    .await
    {
        Ok(body) => body,
        Err(refusal) => return api_error(&refusal),
    };
    let (reply, answer) = oneshot::channel();
    let sent = state.core.send(CoreMsg::Command {
        node_id: node_id.to_owned(),
        request,
        reply,
    });
    if sent.is_err() {
        return api_error(&ApiError::shutting_down());
    }
    match answer.await {
        Ok(Ok(response)) if response.ok => {
            let payload = if response.payload.is_empty() {
                Bytes::from_static(b"{}")
            } else {
                response.payload
            };
            json_response(StatusCode::OK, payload)
        }
        Ok(Ok(response)) => api_error(&ApiError::command_failed(&response.error)),
        Ok(Err(refused)) => api_error(&ApiError::from_command(&refused)),
        Err(_) => api_error(&ApiError::shutting_down()),
    }
}

/// `GET /v1/usage`: every key's limits as they stand and its budget, and usage per key,
/// model and UTC day (the last 62 days), as providers reported it.
pub(super) fn usage(state: &State) -> Response<ResBody> {
    let quota = |q: Option<iop_api::tenant::Quota>| {
        q.map(|q| {
            json!({
                "limit": q.limit,
                "remaining": q.remaining,
                "reset_ms": q.reset.as_millis() as u64,
            })
        })
    };
    let keys: Vec<Value> = state
        .tenants
        .report()
        .into_iter()
        .map(|k| {
            json!({
                "key": &*k.key,
                "in_flight": k.in_flight,
                "requests_per_minute": quota(k.limits.requests),
                "tokens_per_minute": quota(k.limits.tokens),
                "budget": k.budget.map(|b| json!({
                    "tokens": b.budget.tokens,
                    "period": match b.budget.period {
                        iop_api::tenant::Period::Day => "day",
                        iop_api::tenant::Period::Month => "month",
                    },
                    "spent": b.spent,
                    "remaining": b.remaining,
                    "resets_in_ms": b.resets_in.as_millis() as u64,
                })),
            })
        })
        .collect();
    let usage: Vec<Value> = state
        .tenants
        .usage()
        .into_iter()
        .map(|row| {
            json!({
                "key": &*row.key,
                "model": &*row.model,
                "day": row.day,
                "requests": row.counts.requests,
                "prompt_tokens": row.counts.prompt_tokens,
                "completion_tokens": row.counts.completion_tokens,
                "total_tokens": row.counts.prompt_tokens + row.counts.completion_tokens,
            })
        })
        .collect();
    // In cluster mode: each key's figures across every Edge (this one's now, the
    // others' as last read from etcd), and each Edge's own.
    let cluster = state.cluster.as_ref().map(|view| {
        let share = |s: &iop_api::tenant::KeyShare| {
            json!({
                "requests_last_minute": s.requests,
                "tokens_last_minute": s.tokens,
                "in_flight": s.in_flight,
                "budget_spent": s.spent,
                "today": {
                    "requests": s.today.requests,
                    "prompt_tokens": s.today.prompt_tokens,
                    "completion_tokens": s.today.completion_tokens,
                },
            })
        };
        let keys: serde_json::Map<String, Value> = state
            .tenants
            .cluster_report(&view.snapshot().edge_id)
            .into_iter()
            .map(|(key, k)| {
                let edges: serde_json::Map<String, Value> = k
                    .edges
                    .iter()
                    .map(|(id, s)| (id.clone(), share(s)))
                    .collect();
                (
                    key,
                    json!({
                        "requests_last_minute": k.requests,
                        "tokens_last_minute": k.tokens,
                        "in_flight": k.in_flight,
                        "budget_spent": k.spent,
                        "today": {
                            "requests": k.today.requests,
                            "prompt_tokens": k.today.prompt_tokens,
                            "completion_tokens": k.today.completion_tokens,
                            "total_tokens": k.today.prompt_tokens + k.today.completion_tokens,
                        },
                        "edges": edges,
                    }),
                )
            })
            .collect();
        json!({ "detached": state.tenants.detached(), "keys": keys })
    });
    json_response(
        StatusCode::OK,
        Bytes::from(json!({ "keys": keys, "usage": usage, "cluster": cluster }).to_string()),
    )
}
