//! Typed reads of GGUF metadata, shared by the weights and the tokenizer loaders.

use candle_core::quantized::gguf_file::{Content, Value};

use crate::error::{ModelResult, metadata};

pub(crate) fn md_string(ct: &Content, key: &str) -> ModelResult<String> {
    match ct.metadata.get(key) {
        Some(Value::String(s)) => Ok(s.clone()),
        _ => Err(metadata(key)),
    }
}

pub(crate) fn md_usize(ct: &Content, key: &str) -> ModelResult<usize> {
    let v = match ct.metadata.get(key) {
        Some(Value::U8(v)) => u64::from(*v),
        Some(Value::U16(v)) => u64::from(*v),
        Some(Value::U32(v)) => u64::from(*v),
        Some(Value::U64(v)) => *v,
        Some(Value::I32(v)) => u64::try_from(*v).map_err(|_| metadata(key))?,
        Some(Value::I64(v)) => u64::try_from(*v).map_err(|_| metadata(key))?,
        _ => return Err(metadata(key)),
    };
    usize::try_from(v).map_err(|_| metadata(key))
}

pub(crate) fn md_f64(ct: &Content, key: &str) -> ModelResult<f64> {
    match ct.metadata.get(key) {
        Some(Value::F32(v)) => Ok(f64::from(*v)),
        Some(Value::F64(v)) => Ok(*v),
        _ => Err(metadata(key)),
    }
}
