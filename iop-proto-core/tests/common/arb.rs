//! Strategies producing arbitrary values of every wire message.

use std::collections::BTreeMap;

use bytes::Bytes;
use iop_proto_core::wire::*;
use proptest::collection::{btree_map, vec};
use proptest::option;
use proptest::prelude::*;

pub fn text() -> impl Strategy<Value = String> {
    vec(any::<char>(), 0..12).prop_map(String::from_iter)
}

pub fn blob(max: usize) -> impl Strategy<Value = Bytes> {
    vec(any::<u8>(), 0..max).prop_map(Bytes::from)
}

/// Mostly defined enum values, sometimes anything (unknown values must round-trip too).
pub fn enum_value() -> impl Strategy<Value = i32> {
    prop_oneof![4 => 0..8i32, 1 => any::<i32>()]
}

fn labels() -> impl Strategy<Value = BTreeMap<String, String>> {
    btree_map(text(), text(), 0..3)
}

/// Any list of headers.
pub fn headers() -> impl Strategy<Value = Vec<Header>> {
    vec(
        (text(), blob(16)).prop_map(|(name, value)| Header { name, value }),
        0..3,
    )
}

/// Any tunnel frame.
pub fn tunnel_frame() -> impl Strategy<Value = ProviderTunnelFrame> {
    (
        (text(), any::<u64>(), enum_value(), any::<u32>(), headers()),
        (blob(256), any::<bool>(), error_detail(), usage(), labels()),
    )
        .prop_map(
            |(
                (run_id, sequence, kind, status_code, headers),
                (body, end, error, usage, metadata),
            )| {
                ProviderTunnelFrame {
                    run_id,
                    sequence,
                    kind,
                    status_code,
                    headers,
                    body,
                    end,
                    error,
                    usage,
                    metadata,
                }
            },
        )
}

/// Any tunnel request.
pub fn tunnel_request() -> impl Strategy<Value = ProviderTunnelRequest> {
    (
        (text(), text(), text(), text(), text()),
        (
            headers(),
            blob(64),
            any::<bool>(),
            any::<u32>(),
            labels(),
            text(),
            any::<bool>(),
        ),
    )
        .prop_map(
            |(
                (run_id, adapter, target, method, path),
                (headers, body, stream, timeout_sec, metadata, session_id, long_context),
            )| {
                ProviderTunnelRequest {
                    run_id,
                    adapter,
                    target,
                    method,
                    path,
                    headers,
                    body,
                    stream,
                    timeout_sec,
                    metadata,
                    session_id,
                    long_context,
                }
            },
        )
}

fn usage() -> impl Strategy<Value = Option<Usage>> {
    option::of(any::<(u64, u64, u64)>().prop_map(|(p, c, t)| Usage {
        prompt_tokens: p,
        completion_tokens: c,
        total_tokens: t,
    }))
}

fn error_detail() -> impl Strategy<Value = Option<ErrorDetail>> {
    option::of(
        (text(), text(), any::<bool>()).prop_map(|(code, message, retryable)| ErrorDetail {
            code,
            message,
            retryable,
        }),
    )
}

pub fn adapter_config() -> impl Strategy<Value = AdapterConfig> {
    (
        text(),
        enum_value(),
        text(),
        text(),
        any::<u32>(),
        any::<u32>(),
        vec(text(), 0..3),
        any::<bool>(),
        labels(),
    )
        .prop_map(
            |(
                name,
                r#type,
                base_url,
                api_key,
                capacity,
                long_capacity,
                targets,
                enabled,
                options,
            )| {
                AdapterConfig {
                    name,
                    r#type,
                    base_url,
                    api_key,
                    capacity,
                    long_capacity,
                    targets,
                    enabled,
                    options,
                }
            },
        )
}

pub fn config_payload() -> impl Strategy<Value = NodeConfigPayload> {
    (
        any::<u64>(),
        vec(adapter_config(), 0..3),
        option::of(
            any::<(u32, u32, u32)>().prop_map(|(c, h, r)| NodeRuntimeConfig {
                concurrency: c,
                heartbeat_interval_ms: h,
                request_timeout_sec: r,
            }),
        ),
    )
        .prop_map(|(revision, adapters, runtime)| NodeConfigPayload {
            revision,
            adapters,
            runtime,
        })
}

/// Any list of cluster members (some of them invalid: empty or oversized fields).
pub fn cluster_members() -> impl Strategy<Value = ClusterMembers> {
    (text(), vec((text(), text()), 0..4)).prop_map(|(edge_id, members)| ClusterMembers {
        edge_id,
        members: members
            .into_iter()
            .map(|(edge_id, node_addr)| ClusterEdge { edge_id, node_addr })
            .collect(),
    })
}

/// Any envelope body, every variant reachable.
pub fn body() -> impl Strategy<Value = Body> {
    prop_oneof![
        (
            text(),
            text(),
            text(),
            vec(text(), 0..3),
            labels(),
            any::<u64>(),
            any::<bool>(),
            any::<bool>()
        )
            .prop_map(
                |(node_id, token, version, adapter_types, labels, instance_id, rehome, cluster)| {
                    Body::RegisterRequest(RegisterRequest {
                        node_id,
                        token,
                        version,
                        adapter_types,
                        labels,
                        instance_id,
                        rehome,
                        cluster,
                    })
                }
            ),
        (
            any::<bool>(),
            text(),
            text(),
            option::of(config_payload()),
            any::<u32>(),
            any::<u32>(),
            any::<bool>(),
            option::of(cluster_members()),
            any::<bool>()
        )
            .prop_map(
                |(
                    accepted,
                    reason,
                    node_id,
                    config,
                    heartbeat_interval_ms,
                    retry_after_ms,
                    load_reports,
                    cluster,
                    merged_tunnel_frames,
                )| {
                    Body::RegisterResponse(RegisterResponse {
                        accepted,
                        reason,
                        node_id,
                        config,
                        heartbeat_interval_ms,
                        retry_after_ms,
                        load_reports,
                        cluster,
                        merged_tunnel_frames,
                    })
                }
            ),
        cluster_members().prop_map(Body::ClusterMembers),
        (text(), vec(load(), 0..3)).prop_map(|(node_id, held_elsewhere)| Body::NodeReadyRequest(
            NodeReadyRequest {
                node_id,
                held_elsewhere
            }
        )),
        vec(load(), 0..3)
            .prop_map(|held_elsewhere| Body::NodeLoadReport(NodeLoadReport { held_elsewhere })),
        text().prop_map(|reason| Body::NodeRehomeRequest(NodeRehomeRequest { reason })),
        (any::<bool>(), text()).prop_map(|(ready, reason)| Body::NodeReadyResponse(
            NodeReadyResponse { ready, reason }
        )),
        any::<(u64, u64)>()
            .prop_map(|(nonce, sent_at_ms)| Body::Heartbeat(Heartbeat { nonce, sent_at_ms })),
        any::<(u64, u64)>().prop_map(|(nonce, echo_sent_at_ms)| Body::HeartbeatAck(HeartbeatAck {
            nonce,
            echo_sent_at_ms
        })),
        (
            text(),
            text(),
            text(),
            blob(64),
            labels(),
            text(),
            any::<bool>()
        )
            .prop_map(
                |(run_id, adapter, target, input, metadata, session_id, long_context)| {
                    Body::RunRequest(RunRequest {
                        run_id,
                        adapter,
                        target,
                        input,
                        metadata,
                        session_id,
                        long_context,
                    })
                }
            ),
        (
            text(),
            any::<u64>(),
            enum_value(),
            text(),
            labels(),
            usage(),
            error_detail()
        )
            .prop_map(
                |(run_id, sequence, r#type, delta, metadata, usage, error)| {
                    Body::RunEvent(RunEvent {
                        run_id,
                        sequence,
                        r#type,
                        delta,
                        metadata,
                        usage,
                        error,
                    })
                }
            ),
        tunnel_request().prop_map(Body::ProviderTunnelRequest),
        tunnel_frame().prop_map(Body::ProviderTunnelFrame),
        (text(), enum_value(), text()).prop_map(|(run_id, kind, reason)| {
            Body::CancelRequest(CancelRequest {
                run_id,
                kind,
                reason,
            })
        }),
        (text(), enum_value(), text(), text(), text(), blob(32)).prop_map(
            |(request_id, r#type, adapter, method, path, body)| {
                Body::NodeCommandRequest(NodeCommandRequest {
                    request_id,
                    r#type,
                    adapter,
                    method,
                    path,
                    body,
                })
            }
        ),
        (text(), any::<bool>(), text(), blob(32)).prop_map(|(request_id, ok, error, payload)| {
            Body::NodeCommandResponse(NodeCommandResponse {
                request_id,
                ok,
                error,
                payload,
            })
        }),
        (text(), option::of(config_payload())).prop_map(|(request_id, config)| {
            Body::NodeConfigRefreshRequest(NodeConfigRefreshRequest { request_id, config })
        }),
        (text(), enum_value(), text(), any::<u64>()).prop_map(
            |(request_id, status, message, revision)| {
                Body::NodeConfigRefreshResponse(NodeConfigRefreshResponse {
                    request_id,
                    status,
                    message,
                    revision,
                })
            }
        ),
        text().prop_map(|reason| Body::NodeDrainRequest(NodeDrainRequest { reason })),
    ]
}

pub fn envelope() -> impl Strategy<Value = Envelope> {
    body().prop_map(Envelope::new)
}

/// Any `AdapterLoad`.
pub fn load() -> impl Strategy<Value = AdapterLoad> {
    (text(), any::<u32>(), any::<u32>()).prop_map(|(adapter, in_flight, long_in_flight)| {
        AdapterLoad {
            adapter,
            in_flight,
            long_in_flight,
        }
    })
}
