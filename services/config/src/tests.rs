//! The configuration's own tests: layering, validation, secrets, the release build.

use super::*;

/// The build `make test` runs this crate's tests in alone (`cargo test -p engram-config`),
/// as the release binary is built: without the test-only feature, so the key is unknown.
#[cfg(not(feature = "fault-injection"))]
#[test]
fn a_release_build_refuses_fault_injection() {
    let dir = std::env::temp_dir().join(format!("engram-cfg-fault-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("engram.toml");
    std::fs::write(&file, "[model]\nfault = \"panic:X\"\n").unwrap();
    let e = Config::load(Some(&file), Vec::new())
        .unwrap_err()
        .to_string();
    assert!(e.contains("fault"), "{e}");
    let e = Config::load(
        None,
        vec![("ENGRAM__MODEL__FAULT".to_string(), "panic:X".to_string())],
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("fault"), "{e}");
}

#[test]
fn layers_apply_in_order_and_secrets_stay_hidden() {
    let dir = std::env::temp_dir().join(format!("engram-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("engram.toml");
    std::fs::write(
        &file,
        "[server]\nbind = \"0.0.0.0:9000\"\n[model]\ncodec = \"q8\"\n",
    )
    .unwrap();
    let env = vec![
        ("ENGRAM__MODEL__CODEC".to_string(), "f16".to_string()),
        (
            "ENGRAM__AUTH__ADMIN_KEY".to_string(),
            "a-very-long-admin-key".to_string(),
        ),
        ("ENGRAM__TENANTS__SESSIONS".to_string(), "7".to_string()),
        ("UNRELATED".to_string(), "x".to_string()),
    ];
    let c = Config::load(Some(&file), env).unwrap();
    assert_eq!(c.server.bind, "0.0.0.0:9000");
    assert_eq!(c.model.codec, "f16", "env beats file");
    let per_stream = Config::load(
        None,
        vec![("ENGRAM__MODEL__CODEC".to_string(), "q8/tq5".to_string())],
    )
    .unwrap()
    .model
    .engine_config()
    .unwrap();
    assert_eq!(per_stream.kv_profile, None);
    assert_eq!(
        (per_stream.codec, per_stream.value_codec),
        (
            engram_kvcore::CodecKind::Q8,
            Some(engram_kvcore::CodecKind::TurboQuant { bits: 5 })
        )
    );
    assert_eq!(c.tenants.sessions, 7);
    assert_eq!(c.database.url, DatabaseSection::default().url);
    assert!(!format!("{c:?}").contains("a-very-long-admin-key"));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn without_a_codec_each_device_takes_its_built_in_default() {
    use engram_kvcore::CodecKind;
    let engine = |env: Vec<(&str, &str)>| {
        let env: Vec<(String, String)> = env
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::load(None, env)
            .unwrap()
            .model
            .engine_config()
            .unwrap()
    };
    let cpu = engine(vec![]);
    assert_eq!(
        (cpu.codec, cpu.value_codec),
        (
            CodecKind::TurboQuantSplit {
                bits: 6,
                outliers: 1
            },
            Some(CodecKind::TurboQuant { bits: 5 })
        )
    );
    // The CUDA kernel reads TurboQuant-4 only: that is its default.
    let cuda = engine(vec![("ENGRAM__MODEL__DEVICE", "cuda")]);
    assert_eq!((cuda.codec, cuda.value_codec), (CodecKind::TQ4, None));
    // A codec named in the configuration wins on either device.
    let named = engine(vec![
        ("ENGRAM__MODEL__DEVICE", "cuda:1"),
        ("ENGRAM__MODEL__CODEC", "tq4"),
    ]);
    assert_eq!((named.codec, named.value_codec), (CodecKind::TQ4, None));
    let q8 = engine(vec![("ENGRAM__MODEL__CODEC", "q8")]);
    assert_eq!((q8.codec, q8.value_codec), (CodecKind::Q8, None));
    // A checkpoint's built-in profile stands in for the CPU default only: not where a codec
    // or a profile is named, not on CUDA.
    assert!(cpu.built_in_profile);
    assert!(!q8.built_in_profile);
    assert!(!cuda.built_in_profile);
    // Device weights: bf16 unless the configuration asks for f32.
    use engram_engine::DeviceWeights;
    assert_eq!(cpu.device_weights, DeviceWeights::Bf16);
    let f32_products = engine(vec![
        ("ENGRAM__MODEL__DEVICE", "cuda"),
        ("ENGRAM__MODEL__DEVICE_WEIGHTS", "f32"),
    ]);
    assert_eq!(f32_products.device_weights, DeviceWeights::F32);
    // The tiers: sized in tokens of the model's KV by default, in MiB when set (from the
    // environment too), 0 MiB of cold tier meaning none.
    assert_eq!((cpu.hot_tokens, cpu.cold_tokens), (131_072, 262_144));
    let mib = engine(vec![
        ("ENGRAM__MODEL__HOT_MIB", "256"),
        ("ENGRAM__MODEL__COLD_MIB", "0"),
    ]);
    assert_eq!((mib.hot_bytes, mib.hot_tokens), (256 << 20, 0));
    assert_eq!((mib.cold_bytes, mib.cold_tokens), (0, 0));
    // 1 KiB blocks of 16 tokens: 131,072 tokens are 8,192 blocks.
    assert_eq!(cpu.tier_bytes(1024, 16), (8192 * 1024, 16_384 * 1024));
    assert_eq!(mib.tier_bytes(1024, 16), (256 << 20, 0));
}

#[test]
fn bad_values_are_named() {
    let load = |k: &str, v: &str| Config::load(None, vec![(k.to_string(), v.to_string())]);
    for (k, v, key) in [
        ("ENGRAM__SERVER__BIND", "nowhere", "server.bind"),
        ("ENGRAM__AUTH__ADMIN_KEY", "short", "auth.admin_key"),
        ("ENGRAM__DATABASE__URL", "mysql://x", "database.url"),
        ("ENGRAM__MODEL__CODEC", "tq9", "model.codec"),
        ("ENGRAM__MODEL__CODEC", "q8/tq9", "model.codec"),
        // An outlier split is a key codec: not for both streams, not for the values.
        ("ENGRAM__MODEL__CODEC", "tq6o1", "model.codec"),
        ("ENGRAM__MODEL__CODEC", "tq5/tq6o1", "model.codec"),
        (
            "ENGRAM__MODEL__KV_PROFILE",
            "/no/such/profile.json",
            "model.kv_profile",
        ),
        ("ENGRAM__MODEL__WEIGHTS", "int4", "model.weights"),
        (
            "ENGRAM__MODEL__DEVICE_WEIGHTS",
            "fp8",
            "model.device_weights",
        ),
        ("ENGRAM__MODEL__DOWN_TIER_KL", "-1", "model.down_tier_kl"),
        // Without a profile there is no sensitivity to pick the narrower codecs by.
        ("ENGRAM__MODEL__DOWN_TIER_KL", "0.05", "model.down_tier_kl"),
        ("ENGRAM__SHADOW__URL", "gs://bucket", "shadow.url"),
        (
            "ENGRAM__SHADOW__PEERS",
            "s3://b/n2, gs://bucket",
            "shadow.peers",
        ),
        ("ENGRAM__SHADOW__PEERS", "s3://Bad_Bucket", "shadow.peers"),
        (
            "ENGRAM__MODEL__CHAINS_PER_TENANT",
            "0",
            "model.chains_per_tenant",
        ),
        ("ENGRAM__SHADOW__URL", "s3://Bad_Bucket", "shadow.url"),
        (
            "ENGRAM__EVICTION__MASS_WEIGHT",
            "-0.5",
            "eviction.mass_weight",
        ),
        (
            "ENGRAM__EVICTION__RECENCY_WEIGHT",
            "-1",
            "eviction.recency_weight",
        ),
        ("ENGRAM__EVICTION__USE_WEIGHT", "-2", "eviction.use_weight"),
    ] {
        match load(k, v) {
            Err(ConfigError::Invalid { key: got, .. }) => assert_eq!(got, key),
            other => panic!("{k}: {other:?}"),
        }
    }
    assert!(matches!(
        load("ENGRAM__SERVER__NOPE", "1"),
        Err(ConfigError::Parse(_))
    ));
    // An unknown eviction mode is refused by the engine's own type, naming what it takes.
    match load("ENGRAM__EVICTION__MODE", "lru") {
        Err(ConfigError::Parse(m)) => assert!(m.contains("lru") && m.contains("attention"), "{m}"),
        other => panic!("mode lru: {other:?}"),
    }
    for (k, v) in [
        ("ENGRAM__SERVER__BODY_LIMIT_BYTES", "lots"),
        ("ENGRAM__SHADOW__ENABLED", "maybe"),
        ("ENGRAM__TIERS__HOT_HIGH", "high"),
    ] {
        match load(k, v) {
            Err(ConfigError::Parse(m)) => assert!(m.contains(k), "{m}"),
            other => panic!("{k}={v}: {other:?}"),
        }
    }
}

#[test]
fn eviction_settings_reach_the_engine_policy() {
    let c = Config::load(
        None,
        vec![
            ("ENGRAM__EVICTION__MODE".to_string(), "priority".to_string()),
            ("ENGRAM__EVICTION__IDLE_STEPS".to_string(), "64".to_string()),
            (
                "ENGRAM__EVICTION__USE_WEIGHT".to_string(),
                "0.7".to_string(),
            ),
            (
                "ENGRAM__EVICTION__USE_HALF_LIFE".to_string(),
                "4096".to_string(),
            ),
        ],
    )
    .unwrap();
    let p = c.eviction;
    assert_eq!(p.mode, engram_engine::EvictionMode::Priority);
    assert_eq!(p.idle_steps, 64);
    assert_eq!(p.use_weight, 0.7);
    assert_eq!(p.use_half_life, 4096);
    let d = Config::default().eviction;
    assert_eq!(d, engram_engine::EvictionPolicy::default());
}

#[test]
fn tier_settings_are_the_engine_policy_itself() {
    let dir = std::env::temp_dir().join(format!("engram-cfg-tiers-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("engram.toml");
    // Keys the section never mirrored (weights, bounds, costs) reach the policy from a file,
    // the loop's own keys stay the section's, and the environment types a policy field.
    std::fs::write(
        &file,
        "[tiers]\ninterval_ms = 250\nw_recency = 0.3\nhot_high_bounds = [0.82, 0.95]\n\
         hot_budget_bytes = 65536\n[tiers.costs]\nrecompute_ns_per_token = 1000.0\n",
    )
    .unwrap();
    let c = Config::load(
        Some(&file),
        vec![("ENGRAM__TIERS__MAX_MOVES".to_string(), "7".to_string())],
    )
    .unwrap();
    assert_eq!(c.tiers.interval_ms, 250);
    let p = &c.tiers.policy;
    assert_eq!(p.w_recency, 0.3);
    assert_eq!(p.hot_high_bounds, [0.82, 0.95]);
    assert_eq!(p.hot_budget_bytes, 65536);
    assert_eq!(p.costs.recompute_ns_per_token, 1000.0);
    assert_eq!(p.max_moves, 7);
    let d = engram_engine::TierPolicy::default();
    assert_eq!(
        p.cold_budget_bytes, d.cold_budget_bytes,
        "unset keys keep the default"
    );
    assert_eq!(Config::default().tiers.policy, d);
    // An unknown key (the old MiB budget among them) is refused, naming it.
    for bad in ["hot_budget_mib = 64", "nope = 1"] {
        std::fs::write(&file, format!("[tiers]\n{bad}\n")).unwrap();
        match Config::load(Some(&file), Vec::new()) {
            Err(ConfigError::Parse(m)) => {
                let key = bad.split(' ').next().unwrap();
                assert!(m.contains(key), "{m}");
            }
            other => panic!("{bad}: {other:?}"),
        }
    }
    // A loop key of the wrong type is named too.
    std::fs::write(&file, "[tiers]\nenabled = \"often\"\n").unwrap();
    match Config::load(Some(&file), Vec::new()) {
        Err(ConfigError::Parse(m)) => assert!(m.contains("tiers.enabled"), "{m}"),
        other => panic!("enabled: {other:?}"),
    }
}

#[test]
fn environment_values_take_the_type_of_their_field() {
    let env = |pairs: &[(&str, &str)]| {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect::<Vec<_>>()
    };
    // Strings stay strings however they look: a numeric admin key, a boolean-looking
    // device name, a float-looking bucket prefix.
    let c = Config::load(
        None,
        env(&[
            ("ENGRAM__AUTH__ADMIN_KEY", "1234567890123456"),
            ("ENGRAM__MODEL__DEVICE", "cpu"),
            ("ENGRAM__SHADOW__S3_REGION", "1.5"),
            ("ENGRAM__SHADOW__S3_ACCESS_KEY_ID", "true"),
            ("ENGRAM__MODEL__PATH", "42"),
            // Numbers and booleans are parsed as their field's type.
            ("ENGRAM__SERVER__BODY_LIMIT_BYTES", "4096"),
            ("ENGRAM__TIERS__HOT_HIGH", "1"),
            ("ENGRAM__TIERS__STAGE", "false"),
            ("ENGRAM__SHADOW__ENABLED", "false"),
            ("ENGRAM__MEMORY__RESERVE", "0"),
        ]),
    )
    .unwrap();
    assert_eq!(c.auth.admin_key.0, "1234567890123456");
    assert_eq!(c.shadow.s3_region, "1.5");
    assert_eq!(c.shadow.s3_access_key_id, "true");
    assert_eq!(c.model.path, PathBuf::from("42"));
    assert_eq!(c.server.body_limit_bytes, 4096);
    assert!((c.tiers.policy.hot_high - 1.0).abs() < f64::EPSILON);
    // The bridge spills ahead instead of staging (the policy's default is on).
    assert!(engram_engine::TierPolicy::default().stage);
    assert!(!c.tiers.policy.stage);
    assert!(!c.shadow.enabled);
    assert!(!c.memory.reserve);
}
