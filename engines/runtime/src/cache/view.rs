//! What attention reads of one layer of a cache: its keys and values in
//! arrays, quantized, or in place in a paged pool's buffers.

use std::sync::{Arc, Mutex};

use anyhow::anyhow;
use mlx_rs::Array;

use crate::kv_quant::KvQuant;
use crate::paged;

/// A layer's keys and values for every filled column, as attention reads
/// them (`[B, kv_heads, len, _]`, rope applied).
#[derive(Clone)]
pub enum LayerView {
    Dense(Array, Array),
    /// `[codes, scales, biases]` each.
    Quantized {
        quant: KvQuant,
        keys: Vec<Array>,
        values: Vec<Array>,
    },
    /// A paged cache's layer: the pool's key and value buffers (`[slots,
    /// kv_heads, head_dim]`), the token of their last in-place write
    /// (`crate::paged::split_written`), which reads must follow, and where
    /// each row's columns lie in them.
    Paged {
        keys: Array,
        values: Array,
        written: Option<Array>,
        read: PagedRead,
    },
}

impl LayerView {
    /// A layer's columns, one array per buffer of its format (`None`: no
    /// buffers, the layer not written).
    pub(crate) fn of(
        quant: Option<KvQuant>,
        columns: Vec<Array>,
    ) -> anyhow::Result<Option<LayerView>> {
        Ok(match (quant, <[Array; 2]>::try_from(columns)) {
            (_, Err(columns)) if columns.is_empty() => None,
            (None, Ok([k, v])) => Some(LayerView::Dense(k, v)),
            (Some(quant), Err(mut keys)) if keys.len() == 6 => {
                let values = keys.split_off(3);
                Some(LayerView::Quantized {
                    quant,
                    keys,
                    values,
                })
            }
            _ => return Err(anyhow!("KV layer buffers do not match its format")),
        })
    }

    /// Keys and values in the activations' dtype (dequantized where stored
    /// quantized), for readers that need plain arrays.
    pub fn dense(&self) -> anyhow::Result<(Array, Array)> {
        Ok(match self {
            LayerView::Dense(k, v) => (k.clone(), v.clone()),
            LayerView::Quantized {
                quant,
                keys,
                values,
            } => (quant.dequantize(keys)?, quant.dequantize(values)?),
            LayerView::Paged {
                keys,
                values,
                written,
                read,
            } => {
                let w = written.as_ref();
                (read.gather_after(keys, w)?, read.gather_after(values, w)?)
            }
        })
    }
}

/// Where a paged batch's columns `0..total` lie in its pool, for one
/// forward: as slots for a gather, and as block tables for the ragged
/// attention kernel.
#[derive(Clone)]
pub struct PagedRead {
    /// `B * total`: row-major slots of every column.
    slots: Arc<[i32]>,
    /// `slots` as an array, made by the forward's first gather and shared
    /// by every layer's (the kernel reads `tables` and needs none).
    slot_index: Arc<Mutex<Option<Array>>>,
    /// `[B, most blocks]`: each row's block ids (0 past its end).
    pub tables: Array,
    pub block: i32,
    pub total: i32,
    pub rows: i32,
}

impl PagedRead {
    /// The read of a batch of `rows` rows of `total` columns each at
    /// `slots`, their blocks listed in `tables` (`[rows, most blocks]`).
    pub(crate) fn new(slots: Vec<i32>, tables: Array, block: i32, total: i32, rows: i32) -> Self {
        Self {
            slots: slots.into(),
            slot_index: Arc::default(),
            tables,
            block,
            total,
            rows,
        }
    }

    /// `buf` (`[slots, kv_heads, width]`) gathered into the batch's columns,
    /// `[B, kv_heads, total, width]`.
    pub fn gather(&self, buf: &Array) -> anyhow::Result<Array> {
        self.gather_after(buf, None)
    }

    /// [`PagedRead::gather`] after the in-place write `written` is the
    /// token of (`crate::paged::split_written`).
    pub fn gather_after(&self, buf: &Array, written: Option<&Array>) -> anyhow::Result<Array> {
        let s = buf.shape();
        let index = paged::lock(&self.slot_index)
            .get_or_insert_with(|| Array::from_slice(&self.slots, &[self.slots.len() as i32]))
            .clone();
        let index = paged::index_after(&index, written)?;
        Ok(buf
            .take_axis(&index, 0)?
            .reshape(&[self.rows, self.total, s[1], s[2]])?
            .transpose_axes(&[0, 2, 1, 3])?)
    }

    /// A layer's view from its pool `buffers`: read in place when stored in
    /// the activations' dtype, gathered into columns when quantized
    /// (quantized attention takes arrays).
    pub(crate) fn view(
        self,
        quant: Option<KvQuant>,
        buffers: Vec<Array>,
    ) -> anyhow::Result<LayerView> {
        let (mut buffers, written) = crate::paged::split_written(buffers);
        if quant.is_some() {
            let columns = buffers
                .iter()
                .map(|b| self.gather(b))
                .collect::<anyhow::Result<_>>()?;
            return LayerView::of(quant, columns)?
                .ok_or_else(|| anyhow::anyhow!("a quantized layer of no buffers"));
        }
        let values = buffers.pop().expect("two buffers");
        let keys = buffers.pop().expect("two buffers");
        Ok(LayerView::Paged {
            keys,
            values,
            written,
            read: self,
        })
    }
}
