//! The precision allocator on the real model: a short calibration and its profile on disk.

use engram_engine::{EngineConfig, EngineCore, EngineError};
use engram_kvcore::CodecKind;
use engram_lab::calibrate::{CalibrateOptions, KvProfile, Stream, calibrate};

use crate::common::model;
use crate::common::tempdir;

#[test]
fn a_short_calibration_meets_its_budget_and_its_profile_loads_only_for_its_model() {
    let (m, t) = model();
    let tq3 = CodecKind::TurboQuant { bits: 3 };
    let opts = CalibrateOptions {
        max_tokens: 64,
        window: 65,
        chunk: 64,
        candidates: vec![tq3, CodecKind::Q8],
        budget_kl: 0.02,
        group: 30,
        ..CalibrateOptions::default()
    };
    let mut lines = 0;
    let profile = calibrate(m, t, &opts, |_| lines += 1).unwrap();
    // 30 layers × 2 streams × 2 candidates, each measured.
    assert_eq!(profile.sensitivity.len(), 120);
    assert!(lines >= 2);
    // Q8 costs less KL than TQ3 in (nearly) every slot, and keys more than values at TQ3.
    let kl = |layer, stream, codec| {
        profile
            .sensitivity
            .iter()
            .find(|s| s.layer == layer && s.stream == stream && s.codec == codec)
            .unwrap()
            .kl_nats
    };
    let q8_better = (0..30)
        .filter(|&l| kl(l, Stream::Key, CodecKind::Q8) < kl(l, Stream::Key, tq3))
        .count();
    assert!(q8_better >= 27, "{q8_better} of 30 key slots");
    let keys: f64 = (0..30).map(|l| kl(l, Stream::Key, tq3)).sum();
    let values: f64 = (0..30).map(|l| kl(l, Stream::Value, tq3)).sum();
    assert!(keys > values, "keys {keys} values {values}");
    // The allocation: every stream one of the candidates, within the budget as measured (or
    // it says so by taking every round), and cheaper than Q8 everywhere.
    let codecs = &profile.codecs;
    assert!(
        codecs
            .keys()
            .iter()
            .chain(codecs.values())
            .all(|c| [tq3, CodecKind::Q8].contains(c))
    );
    assert!(
        profile.measured_kl <= opts.budget_kl
            || profile.rounds == engram_lab::calibrate::MAX_ROUNDS,
        "{profile:?}"
    );
    assert!(profile.bits_per_element < 8.25 && profile.bits_per_element > 3.25);
    assert_eq!(
        profile.calibration.path,
        engram_lab::calibrate::BUILTIN_NAME
    );

    // Another budget from the same measurements: nothing measured again, fewer bytes.
    let looser = calibrate(
        m,
        t,
        &CalibrateOptions {
            budget_kl: 0.08,
            measured: Some(profile.sensitivity.clone()),
            ..opts.clone()
        },
        |_| {},
    )
    .unwrap();
    assert_eq!(looser.sensitivity, profile.sensitivity);
    assert!(looser.bits_per_element < profile.bits_per_element);
    assert!(looser.predicted_kl > profile.predicted_kl && looser.predicted_kl <= 0.08);

    // On disk and back; an engine built from it stores exactly those codecs.
    let dir = tempdir("calibrate");
    let path = dir.join("smollm2.kv-profile.json");
    profile.save(&path).unwrap();
    let back = KvProfile::load(&path, m).unwrap();
    assert_eq!(
        (&back.codecs, back.model, back.sensitivity.len()),
        (&profile.codecs, profile.model, profile.sensitivity.len())
    );
    assert!((back.measured_kl - profile.measured_kl).abs() < 1e-12);
    let core = EngineCore::new(
        m.clone(),
        t.clone(),
        EngineConfig {
            kv_profile: Some(path.clone()),
            ..EngineConfig::default()
        },
    )
    .unwrap();
    assert_eq!(core.store().codec_kinds(), codecs);
    // A profile of another model is refused, typed.
    let mut other = profile.clone();
    other.model.0[0] ^= 1;
    other.save(&path).unwrap();
    assert!(matches!(
        KvProfile::load(&path, m),
        Err(EngineError::InvalidConfig {
            field: "kv_profile",
            ..
        })
    ));
    std::fs::remove_dir_all(dir).unwrap();
}
