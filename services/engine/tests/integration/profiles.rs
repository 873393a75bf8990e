//! Built-in KV profiles: a checkpoint the engine ships a calibrated profile for (Gemma-3-270M,
//! `make models-test`) takes its codecs when `built_in_profile` is on, and only then; another
//! checkpoint keeps the device default.

use std::path::PathBuf;

use engram_engine::profile::KvProfile;
use engram_engine::{EngineConfig, EngineCore, StreamCodecs};
use engram_kvcore::LayerCodecs;

use crate::common::model_path;

fn gemma() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/gemma-3-270m-q4_k_m.gguf");
    assert!(
        p.is_file(),
        "{} is missing: run `make models-test`",
        p.display()
    );
    p
}

fn small(built_in_profile: bool) -> EngineConfig {
    EngineConfig {
        built_in_profile,
        cold_bytes: 0,
        ..EngineConfig::default()
    }
}

#[test]
fn gemma_takes_its_built_in_profile_only_when_asked() {
    let path = gemma();
    let on = EngineCore::load(&path, small(true)).unwrap();
    let profile = KvProfile::built_in(on.model())
        .unwrap()
        .expect("Gemma-3-270M ships a profile");
    assert_eq!(on.codecs(), &profile.codecs);
    let shape = *on.store().shape();
    let default = LayerCodecs::streams(
        &shape,
        StreamCodecs::CPU_DEFAULT.key,
        StreamCodecs::CPU_DEFAULT.value,
    );
    assert_ne!(
        on.codecs(),
        &default,
        "the profile is not the device default"
    );
    // Within the budget it was made for, at no more than six bits an element.
    assert!(profile.codecs.bits_per_element(shape.head_dim) <= 6.0);
    assert!(profile.measured_kl <= profile.budget_kl);
    // Another fingerprint (the KV format) than the default's: blocks of one are never read as
    // the other's.
    let off = EngineCore::load(&path, small(false)).unwrap();
    assert_eq!(off.codecs(), &default);
    assert_ne!(on.fingerprint(), off.fingerprint());
}

#[test]
fn a_checkpoint_without_a_profile_keeps_the_device_default() {
    let core = EngineCore::load(&model_path(), small(true)).unwrap();
    assert!(KvProfile::built_in(core.model()).unwrap().is_none());
    let shape = *core.store().shape();
    assert_eq!(
        core.codecs(),
        &LayerCodecs::streams(
            &shape,
            StreamCodecs::CPU_DEFAULT.key,
            StreamCodecs::CPU_DEFAULT.value
        )
    );
    // Every built-in profile parses and names a checkpoint.
    let names = KvProfile::built_in_names().unwrap();
    assert!(
        names.iter().any(|(n, _)| *n == "gemma-3-270m-q4_k_m.gguf"),
        "{names:?}"
    );
}
