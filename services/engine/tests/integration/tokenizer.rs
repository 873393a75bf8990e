//! The GGUF-built tokenizer, the chat template and the session text matcher.

use engram_engine::{ChatMessage, Role, TextTokenizer, chatml};

use crate::common::{model, tempdir};

#[test]
fn text_round_trips_exactly() {
    let tok = &model().1;
    let license = std::fs::read_to_string("/usr/share/common-licenses/Apache-2.0").unwrap();
    for text in [
        license.as_str(),
        "  leading spaces, digits 12345, tabs\tand ünïcödé — 東京 🙂\n\n",
    ] {
        let ids = tok.encode(text).unwrap();
        assert_eq!(tok.decode(&ids).unwrap(), text);
    }
    // Digits are split one by one.
    let ids = tok.encode("2026").unwrap();
    assert_eq!(ids.len(), 4);
}

#[test]
fn chatml_control_tokens_are_single_ids_and_stop_generation() {
    let tok = &model().1;
    let text = chatml(&[ChatMessage::new(Role::User, "Hi")], true);
    assert_eq!(
        text,
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    let ids = tok.encode(&text).unwrap();
    let im_start = tok.encode("<|im_start|>").unwrap();
    let im_end = tok.encode("<|im_end|>").unwrap();
    assert_eq!((im_start.len(), im_end.len()), (1, 1));
    assert_eq!(ids[0], im_start[0]);
    assert!(tok.stop_ids().contains(&im_end[0]));
    assert_eq!(ids.iter().filter(|&&i| i == im_end[0]).count(), 1);
}

#[test]
fn a_saved_tokenizer_json_gives_the_same_ids() {
    let tok = &model().1;
    let dir = tempdir("tokjson");
    let path = dir.join("tokenizer.json");
    tok.save_json(&path).unwrap();
    let reloaded = TextTokenizer::from_json_file(&path).unwrap();
    let text = chatml(
        &[ChatMessage::new(Role::System, "You are terse. 42 × 7?")],
        true,
    );
    assert_eq!(reloaded.encode(&text).unwrap(), tok.encode(&text).unwrap());
    assert_eq!(reloaded.stop_ids(), tok.stop_ids());
    std::fs::remove_dir_all(dir).unwrap();
}

/// A stream cut inside a character: `push` holds the incomplete bytes back, `flush` sends them
/// (decoded lossily), and what was streamed equals the decode of every id.
#[test]
fn a_stream_cut_inside_a_character_flushes_what_it_held_back() {
    let tok = &model().1;
    let ids = tok.encode("Hola 🌍😊").unwrap();
    let mut cut = None;
    for n in 1..ids.len() {
        if tok.decode(&ids[..n]).unwrap().ends_with('\u{FFFD}') {
            cut = Some(n);
            break;
        }
    }
    let n = cut.expect("an emoji spans several byte tokens");
    let mut d = engram_engine::StreamDecoder::default();
    let mut streamed = String::new();
    for &id in &ids[..n] {
        streamed.push_str(&d.push(tok, id).unwrap());
    }
    assert!(!streamed.ends_with('\u{FFFD}'), "{streamed:?}");
    streamed.push_str(&d.flush(tok).unwrap());
    assert_eq!(streamed, tok.decode(&ids[..n]).unwrap());
    assert!(streamed.ends_with('\u{FFFD}'));
    assert_eq!(d.flush(tok).unwrap(), "");
}

/// A long reply streams in pieces that add up to the decode of every id, each push decoding a
/// short window rather than everything so far.
#[test]
fn a_long_stream_decodes_a_short_window_per_token_and_adds_up_to_the_whole() {
    let tok = &model().1;
    let text = "Grüße aus Köln — 東京の天気は晴れ 🌍😊, then plain English prose with spaces,  \
                double  spaces, tabs\tand newlines\n. "
        .repeat(12);
    let ids = tok.encode(&text).unwrap();
    assert!(ids.len() > 400, "{}", ids.len());
    let mut d = engram_engine::StreamDecoder::default();
    let mut streamed = String::new();
    let mut widest = 0;
    for &id in &ids {
        widest = widest.max(d.window());
        streamed.push_str(&d.push(tok, id).unwrap());
    }
    streamed.push_str(&d.flush(tok).unwrap());
    assert_eq!(streamed, tok.decode(&ids).unwrap());
    assert_eq!(d.text(tok).unwrap(), streamed);
    assert!(widest <= 8, "a push decoded {widest} ids of {}", ids.len());
}

#[test]
fn the_model_s_own_chat_template_is_read_from_the_gguf_and_frames_like_chatml() {
    let tok = TextTokenizer::for_model(&crate::common::model_path()).unwrap();
    let f = tok.chat_format();
    // SmolLM2's template is a ChatML variant: its pieces are ChatML's, but they come from it.
    assert_eq!(f.source, engram_context::FormatSource::Model);
    let chatml = engram_context::ChatFormat::chatml();
    assert_eq!(
        (&f.first_system_pre, &f.user, &f.assistant, &f.generation),
        (
            &chatml.first_system_pre,
            &chatml.user,
            &chatml.assistant,
            &chatml.generation
        )
    );
    // The template's own rendering of a conversation tokenizes like the framed one.
    let template = engram_engine::chat_template::Template::new(
        &read_template(&crate::common::model_path()),
        "<|im_start|>",
        "<|im_end|>",
    )
    .unwrap();
    let conv = [
        (engram_context::FrameRole::System, "Be brief."),
        (engram_context::FrameRole::User, "Name a colour."),
    ];
    let rendered = template.render(&conv, true).unwrap();
    assert_eq!(f.render(&conv, true), rendered);
    assert!(tok.encode(&rendered).unwrap().len() > 5);
}

/// `tokenizer.chat_template` of a GGUF file.
fn read_template(path: &std::path::Path) -> String {
    let mut f = std::io::BufReader::new(std::fs::File::open(path).unwrap());
    let ct = candle_core::quantized::gguf_file::Content::read(&mut f).unwrap();
    match ct.metadata.get("tokenizer.chat_template") {
        Some(candle_core::quantized::gguf_file::Value::String(s)) => s.clone(),
        other => panic!("no template: {other:?}"),
    }
}
