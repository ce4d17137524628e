//! Routing replay: the experts a mixture-of-experts model's router chose for each token, as the
//! server reported them, kept per training row.

use std::ops::Range;

use base64::Engine as _;
use serde::{Deserialize, Serialize, de, ser::SerializeMap};

/// The experts the router chose for a run of consecutive positions of one request's sequence
/// (its prompt ids, then its sampled ids), as vLLM's `--enable-return-routed-experts`
/// reports them: per position and layer, `top_k` expert ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutedExperts {
    /// The first position reported (the request's `routed_experts_prompt_start`).
    pub start: usize,
    /// Positions reported.
    pub tokens: usize,
    /// Layers per position (every hidden layer the server reports).
    pub layers: usize,
    /// Experts per layer.
    pub top_k: usize,
    /// The width of an expert id: uint8 (at most 256 experts) or uint16.
    pub dtype: ExpertDtype,
    /// `tokens * layers * top_k` ids, position-major, each `dtype` little-endian.
    pub data: Vec<u8>,
}

/// The integer type of expert ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ExpertDtype {
    /// One byte.
    Uint8,
    /// Two bytes, little-endian.
    Uint16,
}

impl ExpertDtype {
    /// Bytes per id.
    pub fn width(self) -> usize {
        match self {
            ExpertDtype::Uint8 => 1,
            ExpertDtype::Uint16 => 2,
        }
    }
}

impl RoutedExperts {
    /// Bytes of one position's ids.
    pub fn stride(&self) -> usize {
        self.layers * self.top_k * self.dtype.width()
    }
}

/// A training row's routing: for every token of its `input_ids`, per layer, the `top_k`
/// experts the server's router chose, from the first response that reported the token.
/// Tokens no response reported (always the row's last token: the server never runs the
/// model on the last id it samples) are `missing`, their ids zeros.
///
/// Written as `{"shape": [tokens, layers, top_k], "dtype": "uint8"|"uint16", "data": BASE64,
/// "missing": [[start, end], ...]}`, `data` the ids position-major, little-endian.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowRouting {
    /// Layers per token.
    pub layers: usize,
    /// Experts per layer.
    pub top_k: usize,
    /// The width of an id.
    pub dtype: ExpertDtype,
    /// `tokens * layers * top_k` ids, position-major, little-endian.
    pub data: Vec<u8>,
    /// Spans of tokens whose routing no response reported, in order.
    pub missing: Vec<Range<usize>>,
}

impl RowRouting {
    /// Bytes of one token's ids.
    pub fn stride(&self) -> usize {
        self.layers * self.top_k * self.dtype.width()
    }

    /// Tokens covered (reported or missing).
    pub fn tokens(&self) -> usize {
        self.data.len() / self.stride().max(1)
    }

    /// Tokens whose routing is missing.
    pub fn missing_tokens(&self) -> usize {
        self.missing.iter().map(ExactSizeIterator::len).sum()
    }

    /// The `top_k` expert ids of `token` at `layer`, or `None` when missing or out of range.
    pub fn experts(&self, token: usize, layer: usize) -> Option<Vec<u16>> {
        if layer >= self.layers || self.missing.iter().any(|m| m.contains(&token)) {
            return None;
        }
        let width = self.dtype.width();
        let at = token * self.stride() + layer * self.top_k * width;
        let bytes = self.data.get(at..at + self.top_k * width)?;
        Some(match self.dtype {
            ExpertDtype::Uint8 => bytes.iter().map(|&b| u16::from(b)).collect(),
            ExpertDtype::Uint16 => bytes
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                .collect(),
        })
    }

    /// A row's routing of the same layout as `first`, with no token yet.
    pub(crate) fn like(first: &RoutedExperts) -> RowRouting {
        RowRouting {
            layers: first.layers,
            top_k: first.top_k,
            dtype: first.dtype,
            data: Vec::new(),
            missing: Vec::new(),
        }
    }

    /// Whether `reported` has this row's layout.
    pub(crate) fn fits(&self, reported: &RoutedExperts) -> bool {
        (self.layers, self.top_k, self.dtype) == (reported.layers, reported.top_k, reported.dtype)
    }

    /// Keeps the first `tokens` tokens.
    pub(crate) fn truncate(&mut self, tokens: usize) {
        self.data.truncate(tokens * self.stride());
        self.missing.retain(|m| m.start < tokens);
        if let Some(last) = self.missing.last_mut() {
            last.end = last.end.min(tokens);
        }
    }

    /// Grows the row to `tokens` tokens, the new ones missing.
    pub(crate) fn pad_to(&mut self, tokens: usize) {
        let have = self.tokens();
        if tokens <= have {
            return;
        }
        self.data.resize(tokens * self.stride(), 0);
        match self.missing.last_mut() {
            Some(last) if last.end == have => last.end = tokens,
            _ => self.missing.push(have..tokens),
        }
    }

    /// Takes `reported`'s routing of the tokens from `from` on (those before are kept as
    /// first reported). `reported` must fit and start at or before `from`, and the row must
    /// hold exactly `from` tokens.
    pub(crate) fn extend_from(&mut self, reported: &RoutedExperts, from: usize) {
        let skip = (from - reported.start) * self.stride();
        self.data.extend_from_slice(&reported.data[skip..]);
    }
}

impl Serialize for RowRouting {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(4))?;
        map.serialize_entry("shape", &[self.tokens(), self.layers, self.top_k])?;
        map.serialize_entry("dtype", &self.dtype)?;
        map.serialize_entry(
            "data",
            &base64::engine::general_purpose::STANDARD.encode(&self.data),
        )?;
        let missing: Vec<[usize; 2]> = self.missing.iter().map(|m| [m.start, m.end]).collect();
        map.serialize_entry("missing", &missing)?;
        map.end()
    }
}

impl<'de> Deserialize<'de> for RowRouting {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Wire {
            shape: [usize; 3],
            dtype: ExpertDtype,
            data: String,
            #[serde(default)]
            missing: Vec<[usize; 2]>,
        }
        let wire = Wire::deserialize(deserializer)?;
        let data = base64::engine::general_purpose::STANDARD
            .decode(wire.data.as_bytes())
            .map_err(|e| de::Error::custom(format!("routed_experts.data is not base64: {e}")))?;
        let [tokens, layers, top_k] = wire.shape;
        let expected = tokens * layers * top_k * wire.dtype.width();
        if data.len() != expected {
            return Err(de::Error::custom(format!(
                "routed_experts.data holds {} bytes, but shape {:?} of {:?} needs {expected}",
                data.len(),
                wire.shape,
                wire.dtype
            )));
        }
        Ok(RowRouting {
            layers,
            top_k,
            dtype: wire.dtype,
            data,
            missing: wire.missing.iter().map(|&[s, e]| s..e).collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_s_routing_is_written_as_shape_dtype_base64_and_missing_and_read_back() {
        let routing = RowRouting {
            layers: 2,
            top_k: 2,
            dtype: ExpertDtype::Uint16,
            data: [1u16, 2, 3, 4, 300, 6, 7, 8]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .chain([0; 8])
                .collect(),
            missing: std::iter::once(2..3).collect(),
        };
        // Two tokens of two layers of two experts, then a missing third token.
        assert_eq!(routing.tokens(), 3);
        assert_eq!(routing.experts(1, 0), Some(vec![300, 6]));
        assert_eq!(routing.experts(2, 0), None, "missing");
        let text = serde_json::to_string(&routing).expect("serializes");
        assert!(
            text.starts_with(r#"{"shape":[3,2,2],"dtype":"uint16","data":""#),
            "{text}"
        );
        assert!(text.ends_with(r#"","missing":[[2,3]]}"#), "{text}");
        let back: RowRouting = serde_json::from_str(&text).expect("reads back");
        assert_eq!(back, routing);
        let short = text.replace("[3,2,2]", "[4,2,2]");
        let error = serde_json::from_str::<RowRouting>(&short).expect_err("shape and bytes differ");
        assert!(error.to_string().contains("needs 32"), "{error}");
    }
}
