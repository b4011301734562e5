//! Unit tests of `validate`.

use super::*;

#[test]
fn request_ids_fit_for_logs_and_headers() {
    for good in ["a", "req_0123abcd", "trace-4f1c:abc_123", "org/x+y=z@h.k"] {
        assert!(is_request_id(good.as_bytes()), "{good}");
    }
    let long = "x".repeat(129);
    for bad in [
        "",
        "has space",
        "quote\"",
        "line\nbreak",
        "tab\t",
        long.as_str(),
        "é",
    ] {
        assert!(!is_request_id(bad.as_bytes()), "{bad:?}");
    }
}

fn mock_adapter(name: &str) -> AdapterConfig {
    AdapterConfig {
        name: name.into(),
        r#type: AdapterType::Mock as i32,
        capacity: 2,
        long_capacity: 1,
        targets: vec!["m".into()],
        enabled: true,
        ..Default::default()
    }
}

#[test]
fn cancel_needs_a_run_id_and_a_known_kind() {
    let ok = CancelRequest {
        run_id: "r1".into(),
        kind: CancelKind::CancelRun as i32,
        reason: String::new(),
    };
    assert_eq!(ok.validate(), Ok(()));
    let terminate = CancelRequest {
        kind: CancelKind::TerminateSession as i32,
        ..ok.clone()
    };
    assert_eq!(terminate.validate(), Ok(()));
    assert_eq!(
        CancelRequest {
            run_id: String::new(),
            ..ok.clone()
        }
        .validate(),
        Err(ValidationError::EmptyField {
            message: "CancelRequest",
            field: "run_id"
        })
    );
    assert_eq!(
        CancelRequest {
            kind: 9,
            ..ok.clone()
        }
        .validate(),
        Err(ValidationError::UnknownEnumValue {
            message: "CancelRequest",
            field: "kind",
            value: 9
        })
    );
    assert_eq!(
        CancelRequest { kind: 0, ..ok }.validate(),
        Err(ValidationError::UnspecifiedEnum {
            message: "CancelRequest",
            field: "kind"
        })
    );
}

#[test]
fn node_commands_admit_only_the_three_types() {
    let base = NodeCommandRequest {
        request_id: "c1".into(),
        r#type: NodeCommandType::Capabilities as i32,
        ..Default::default()
    };
    assert_eq!(base.validate(), Ok(()));
    let status = NodeCommandRequest {
        r#type: NodeCommandType::TransportStatus as i32,
        ..base.clone()
    };
    assert_eq!(status.validate(), Ok(()));
    for value in [0, 4, 5, 6, 42, -1] {
        // Rejected before anything else is looked at, even with an empty request_id.
        let cmd = NodeCommandRequest {
            r#type: value,
            request_id: String::new(),
            ..base.clone()
        };
        assert_eq!(
            cmd.validate(),
            Err(ValidationError::CommandNotAdmitted { value })
        );
    }
}

#[test]
fn ollama_api_is_limited_to_read_only_endpoints() {
    let cmd = |method: &str, path: &str| NodeCommandRequest {
        request_id: "c1".into(),
        r#type: NodeCommandType::OllamaApi as i32,
        adapter: "ollama".into(),
        method: method.into(),
        path: path.into(),
        body: Default::default(),
    };
    for (method, path) in OLLAMA_API_ENDPOINTS {
        assert_eq!(cmd(method, path).validate(), Ok(()));
    }
    for (method, path) in [
        ("POST", "/api/pull"),
        ("DELETE", "/api/delete"),
        ("POST", "/api/tags"),
        ("GET", "/api/show"),
        ("POST", "/api/generate"),
    ] {
        assert!(matches!(
            cmd(method, path).validate(),
            Err(ValidationError::OllamaEndpointNotAdmitted { .. })
        ));
    }
    let mut no_adapter = cmd("GET", "/api/tags");
    no_adapter.adapter.clear();
    assert!(matches!(
        no_adapter.validate(),
        Err(ValidationError::EmptyField {
            field: "adapter",
            ..
        })
    ));
}

#[test]
fn adapter_type_must_be_known() {
    for value in [0, 5, 99] {
        let adapter = AdapterConfig {
            r#type: value,
            ..mock_adapter("a")
        };
        assert!(
            matches!(adapter.validate(), Err(ValidationError::InvalidAdapter { problem, .. }) if problem.contains("type")),
            "type {value} accepted"
        );
    }
    assert_eq!(mock_adapter("a").validate(), Ok(()));
}

#[test]
fn adapter_capacities_and_urls_are_checked() {
    let zero = AdapterConfig {
        capacity: 0,
        long_capacity: 0,
        ..mock_adapter("a")
    };
    assert!(zero.validate().is_err());
    let disabled_zero = AdapterConfig {
        enabled: false,
        ..zero
    };
    assert_eq!(disabled_zero.validate(), Ok(()));
    let long_over = AdapterConfig {
        long_capacity: 3,
        ..mock_adapter("a")
    };
    assert!(long_over.validate().is_err());
    let no_url = AdapterConfig {
        r#type: AdapterType::OpenaiCompat as i32,
        ..mock_adapter("a")
    };
    assert!(no_url.validate().is_err());
    let with_url = AdapterConfig {
        base_url: "https://llm.internal:8443".into(),
        ..no_url
    };
    assert_eq!(with_url.validate(), Ok(()));
    for url in [
        "http://user:hunter2@127.0.0.1:9000",
        "https://hunter2@provider.example/v1",
    ] {
        let with_credentials = AdapterConfig {
            base_url: url.into(),
            ..with_url.clone()
        };
        let err = with_credentials.validate().unwrap_err().to_string();
        assert!(
            err.contains("credentials") && !err.contains("hunter2"),
            "{err}"
        );
    }
    // An `@` in the path is a path.
    let at_in_path = AdapterConfig {
        base_url: "http://127.0.0.1:9000/v1/@team".into(),
        ..with_url
    };
    assert_eq!(at_in_path.validate(), Ok(()));
}

#[test]
fn dispatch_option_is_checked() {
    let mut adapter = mock_adapter("a");
    adapter.options.insert("dispatch".into(), "tunnel".into());
    assert_eq!(
        adapter.validate(),
        Ok(()),
        "the mock answers tunnels itself"
    );
    let ollama = AdapterConfig {
        r#type: AdapterType::Ollama as i32,
        base_url: "http://127.0.0.1:11434".into(),
        ..adapter.clone()
    };
    assert!(ollama.validate().is_err(), "ollama cannot be tunnelled");
    adapter.options.insert("dispatch".into(), "run".into());
    assert_eq!(adapter.validate(), Ok(()));
    adapter.options.insert("dispatch".into(), "sideways".into());
    assert!(adapter.validate().is_err());
}

#[test]
fn adapter_names_are_unique_counting_legacy_names() {
    let payload = NodeConfigPayload {
        revision: 1,
        adapters: vec![mock_adapter(""), mock_adapter("mock")],
        runtime: None,
    };
    assert_eq!(
        payload.validate(),
        Err(ValidationError::DuplicateAdapter {
            name: "mock".into()
        })
    );
}

#[test]
fn events_and_frames_need_known_kinds() {
    let event = RunEvent {
        run_id: "r".into(),
        r#type: 77,
        ..Default::default()
    };
    assert!(matches!(
        event.validate(),
        Err(ValidationError::UnknownEnumValue { value: 77, .. })
    ));
    let frame = ProviderTunnelFrame {
        run_id: "r".into(),
        kind: 0,
        ..Default::default()
    };
    assert!(matches!(
        frame.validate(),
        Err(ValidationError::UnspecifiedEnum { field: "kind", .. })
    ));
    let refresh = NodeConfigRefreshResponse {
        request_id: "q".into(),
        status: 8,
        ..Default::default()
    };
    assert!(refresh.validate().is_err());
}

#[test]
fn accepted_register_response_carries_a_valid_config() {
    let accepted = RegisterResponse {
        accepted: true,
        node_id: "n1".into(),
        ..Default::default()
    };
    assert_eq!(
        accepted.validate(),
        Err(ValidationError::MissingField {
            message: "RegisterResponse",
            field: "config"
        })
    );
    let rejected = RegisterResponse {
        accepted: false,
        reason: "bad token".into(),
        ..Default::default()
    };
    assert_eq!(rejected.validate(), Ok(()));
}

#[test]
fn tunnel_paths_are_absolute() {
    let req = ProviderTunnelRequest {
        run_id: "r".into(),
        adapter: "a".into(),
        method: "POST".into(),
        path: "v1/chat/completions".into(),
        ..Default::default()
    };
    assert!(matches!(
        req.validate(),
        Err(ValidationError::RelativePath { .. })
    ));
}
