//! The GGUF container (versions 2 and 3): header, metadata key/values and
//! tensor descriptors, read with bounds checks so that a truncated or
//! corrupt file is an error naming what broke, never a panic or a huge
//! allocation.
//!
//! Why not a crate: `ggus` 0.5 (the maintained GGUF crate) reads enum tags
//! straight from file bytes (undefined behaviour on an unknown tensor or
//! value type), panics (`todo!`, `unimplemented!`, `assert!`) on tensor
//! types it does not size, and its companion `ggml-quants` 0.1 leaves Q6_K
//! dequantization as `todo!()`. The format itself is small.

use std::collections::HashMap;

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Int(i64),
    Uint(u64),
    Float(f64),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
}

impl Value {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::Uint(v) => Some(v),
            Value::Int(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::Float(v) => Some(v),
            Value::Uint(v) => Some(v as f64),
            Value::Int(v) => Some(v as f64),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// GGML tensor types this runtime reads (ids from ggml.h).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorType {
    F32,
    F16,
    Bf16,
    Q4_0,
    Q4_1,
    Q8_0,
    Q5_0,
    Q4K,
    Q5K,
    Q6K,
}

impl TensorType {
    fn from_id(id: u32) -> Result<Self, u32> {
        Ok(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            8 => Self::Q8_0,
            12 => Self::Q4K,
            13 => Self::Q5K,
            14 => Self::Q6K,
            30 => Self::Bf16,
            other => return Err(other),
        })
    }

    /// (elements per block, bytes per block).
    pub fn block(self) -> (usize, usize) {
        match self {
            Self::F32 => (1, 4),
            Self::F16 | Self::Bf16 => (1, 2),
            Self::Q4_0 => (32, 18),
            Self::Q4_1 => (32, 20),
            Self::Q8_0 => (32, 34),
            Self::Q5_0 => (32, 22),
            Self::Q4K => (256, 144),
            Self::Q5K => (256, 176),
            Self::Q6K => (256, 210),
        }
    }
}

/// The name ggml gives a tensor type id, for error messages.
fn type_name(id: u32) -> String {
    const NAMES: &[(u32, &str)] = &[
        (7, "Q5_1"),
        (9, "Q8_1"),
        (10, "Q2_K"),
        (11, "Q3_K"),
        (15, "Q8_K"),
        (16, "IQ2_XXS"),
        (17, "IQ2_XS"),
        (18, "IQ3_XXS"),
        (19, "IQ1_S"),
        (20, "IQ4_NL"),
        (21, "IQ3_S"),
        (22, "IQ2_S"),
        (23, "IQ4_XS"),
        (24, "I8"),
        (25, "I16"),
        (26, "I32"),
        (27, "I64"),
        (28, "F64"),
        (29, "IQ1_M"),
        (34, "TQ1_0"),
        (35, "TQ2_0"),
        (39, "MXFP4"),
    ];
    NAMES
        .iter()
        .find(|(i, _)| *i == id)
        .map(|(_, n)| format!("{n} (type {id})"))
        .unwrap_or_else(|| format!("unknown type {id}"))
}

#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// Row-major shape (GGUF lists dimensions innermost first; reversed here).
    pub shape: Vec<usize>,
    pub ty: TensorType,
    /// Byte range in the file.
    pub start: usize,
    pub len: usize,
}

impl TensorInfo {
    /// Elements in one row (the innermost dimension).
    pub fn row_len(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }

    pub fn rows(&self) -> usize {
        self.shape.iter().rev().skip(1).product()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("not a GGUF file (magic {0:?})")]
    Magic([u8; 4]),
    #[error("GGUF version {0} is not supported (2 and 3 are)")]
    Version(u32),
    #[error("truncated or corrupt: {0}")]
    Corrupt(String),
    #[error("tensor `{name}` has type {ty}, which this runtime cannot load (supported: F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q5_0, Q4_K, Q5_K, Q6_K)")]
    UnsupportedType { name: String, ty: String },
}

/// A parsed GGUF file; tensor data stays in `data` (the whole file).
pub struct GgufFile {
    pub data: Vec<u8>,
    pub metadata: HashMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
}

impl GgufFile {
    pub fn parse(data: Vec<u8>) -> Result<Self, GgufError> {
        let mut r = Reader {
            data: &data,
            pos: 0,
        };
        let magic: [u8; 4] = r.bytes(4, "magic")?.try_into().expect("4 bytes");
        if &magic != b"GGUF" {
            return Err(GgufError::Magic(magic));
        }
        let version = r.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::Version(version));
        }
        let n_tensors = r.u64("tensor count")?;
        let n_kv = r.u64("metadata count")?;
        let mut metadata = HashMap::new();
        for i in 0..n_kv {
            let key = r.string(&format!("metadata key {i}"))?;
            let ty = r.u32(&format!("type of `{key}`"))?;
            let value = r.value(ty, &key, 0)?;
            metadata.insert(key, value);
        }
        let alignment = match metadata.get("general.alignment") {
            None => 32,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() => a as usize,
                _ => return Err(corrupt(format!("general.alignment {v:?}"))),
            },
        };
        let mut raw = Vec::new();
        for i in 0..n_tensors {
            let name = r.string(&format!("name of tensor {i}"))?;
            let n_dims = r.u32(&format!("rank of `{name}`"))?;
            if n_dims == 0 || n_dims > 4 {
                return Err(corrupt(format!("`{name}` has {n_dims} dimensions")));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(r.u64(&format!("shape of `{name}`"))?);
            }
            let ty = r.u32(&format!("type of `{name}`"))?;
            let offset = r.u64(&format!("offset of `{name}`"))?;
            raw.push((name, dims, ty, offset));
        }
        let base = r.pos.div_ceil(alignment) * alignment;
        let mut tensors = Vec::with_capacity(raw.len());
        for (name, dims, ty, offset) in raw {
            let ty = TensorType::from_id(ty).map_err(|id| GgufError::UnsupportedType {
                name: name.clone(),
                ty: type_name(id),
            })?;
            let (block_elems, block_bytes) = ty.block();
            let elems = dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .filter(|&n| n > 0 && n < (1 << 40))
                .ok_or_else(|| corrupt(format!("`{name}` has shape {dims:?}")))?;
            if dims[0] % block_elems as u64 != 0 {
                return Err(corrupt(format!(
                    "`{name}`: rows of {} elements do not fill {ty:?} blocks of {block_elems}",
                    dims[0]
                )));
            }
            let len = (elems / block_elems as u64) as usize * block_bytes;
            let start = base
                .checked_add(usize::try_from(offset).unwrap_or(usize::MAX))
                .filter(|s| s.checked_add(len).is_some_and(|end| end <= data.len()))
                .ok_or_else(|| {
                    corrupt(format!(
                        "`{name}` ({len} bytes at offset {offset}) runs past the end of the file ({} bytes)",
                        data.len()
                    ))
                })?;
            tensors.push(TensorInfo {
                name,
                shape: dims.iter().rev().map(|&d| d as usize).collect(),
                ty,
                start,
                len,
            });
        }
        Ok(Self {
            data,
            metadata,
            tensors,
        })
    }

    pub fn bytes(&self, t: &TensorInfo) -> &[u8] {
        &self.data[t.start..t.start + t.len]
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

fn corrupt(what: String) -> GgufError {
    GgufError::Corrupt(what)
}

struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn bytes(&mut self, n: usize, what: &str) -> Result<&'a [u8], GgufError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.data.len())
            .ok_or_else(|| corrupt(format!("{what} runs past the end of the file")))?;
        let out = &self.data[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        Ok(self.bytes(N, what)?.try_into().expect("N bytes"))
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A length that must fit in what is left of the file (each item takes
    /// at least `min_item` bytes), so a corrupt count cannot allocate.
    fn count(&mut self, min_item: usize, what: &str) -> Result<usize, GgufError> {
        let n = self.u64(what)?;
        let left = (self.data.len() - self.pos) as u64;
        if n.saturating_mul(min_item as u64) > left {
            return Err(corrupt(format!("{what}: {n} items do not fit in the file")));
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let n = self.count(1, what)?;
        let bytes = self.bytes(n, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| corrupt(format!("{what} is not UTF-8")))
    }

    fn value(&mut self, ty: u32, key: &str, depth: u32) -> Result<Value, GgufError> {
        Ok(match ty {
            0 => Value::Uint(self.array::<1>(key)?[0] as u64),
            1 => Value::Int(i8::from_le_bytes(self.array(key)?) as i64),
            2 => Value::Uint(u16::from_le_bytes(self.array(key)?) as u64),
            3 => Value::Int(i16::from_le_bytes(self.array(key)?) as i64),
            4 => Value::Uint(self.u32(key)? as u64),
            5 => Value::Int(i32::from_le_bytes(self.array(key)?) as i64),
            6 => Value::Float(f32::from_le_bytes(self.array(key)?) as f64),
            7 => match self.array::<1>(key)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(corrupt(format!("`{key}`: bool byte {b}"))),
            },
            8 => Value::Str(self.string(key)?),
            9 if depth == 0 => {
                let item_ty = self.u32(key)?;
                let n = self.count(1, key)?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(item_ty, key, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::Uint(self.u64(key)?),
            11 => Value::Int(i64::from_le_bytes(self.array(key)?)),
            12 => Value::Float(f64::from_le_bytes(self.array(key)?)),
            other => return Err(corrupt(format!("`{key}` has value type {other}"))),
        })
    }
}
