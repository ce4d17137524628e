//! vLLM's routed experts (`--enable-return-routed-experts`): a base64 `.npy` array per choice.

use base64::Engine as _;

/// The experts a mixture-of-experts model's router chose, as vLLM reports them for a choice:
/// for each position from the request's `routed_experts_prompt_start` to the last but one
/// sampled token (the model never runs on the last id it samples), per hidden layer, the
/// `top_k` expert ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutedExperts {
    /// `[positions, layers, top_k]`.
    pub shape: [usize; 3],
    /// Bytes per id: 1 (`uint8`, at most 256 experts) or 2 (`uint16`).
    pub width: usize,
    /// The ids, position-major, little-endian.
    pub data: Vec<u8>,
}

impl RoutedExperts {
    /// Decodes vLLM's `routed_experts`: base64 of the bytes `numpy.save` writes (format 1.0,
    /// 2.0 or 3.0) of a C-ordered 3-dimensional `uint8` or `uint16` array.
    pub fn from_base64_npy(text: &str) -> Result<RoutedExperts, String> {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(text.as_bytes())
            .map_err(|e| format!("not base64: {e}"))?;
        let rest = bytes
            .strip_prefix(b"\x93NUMPY")
            .ok_or("not a .npy array (no \\x93NUMPY magic)")?;
        let (header_len, rest) = match rest {
            [1, _, a, b, rest @ ..] => (usize::from(u16::from_le_bytes([*a, *b])), rest),
            [2 | 3, _, a, b, c, d, rest @ ..] => {
                (u32::from_le_bytes([*a, *b, *c, *d]) as usize, rest)
            }
            _ => return Err("an unknown .npy format version".to_owned()),
        };
        let header = rest
            .get(..header_len)
            .ok_or("the .npy header is cut short")?;
        let header = std::str::from_utf8(header).map_err(|_| "the .npy header is not text")?;
        let data = &rest[header_len..];
        let width = match quoted(header, "descr") {
            Some("|u1" | "<u1" | "=u1" | "u1") => 1,
            Some("<u2") => 2,
            other => {
                return Err(format!(
                    "expert ids of dtype {other:?}; uint8 ('|u1') or little-endian uint16 ('<u2') expected"
                ));
            }
        };
        if !header.contains("'fortran_order': False") {
            return Err("a Fortran-ordered array; C order expected".to_owned());
        }
        let shape = shape(header).ok_or("no 3-dimensional 'shape' in the .npy header")?;
        let expected = shape.iter().product::<usize>() * width;
        if data.len() != expected {
            return Err(format!(
                "{} bytes of ids for shape {shape:?}, which needs {expected}",
                data.len()
            ));
        }
        Ok(RoutedExperts {
            shape,
            width,
            data: data.to_vec(),
        })
    }
}

/// The quoted value of `'key': '...'` in a `.npy` header.
fn quoted<'h>(header: &'h str, key: &str) -> Option<&'h str> {
    let rest = &header[header.find(&format!("'{key}':"))? + key.len() + 3..];
    let rest = rest.trim_start().strip_prefix('\'')?;
    Some(&rest[..rest.find('\'')?])
}

/// The `'shape': (a, b, c)` of a `.npy` header, when it has three dimensions.
fn shape(header: &str) -> Option<[usize; 3]> {
    let rest = &header[header.find("'shape':")? + 8..];
    let rest = rest.trim_start().strip_prefix('(')?;
    let dims: Vec<usize> = rest[..rest.find(')')?]
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .map(str::parse)
        .collect::<Result<_, _>>()
        .ok()?;
    dims.try_into().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `numpy.save` writes for `numpy.arange(12, dtype=DTYPE).reshape(2, 3, 2)`.
    fn npy(descr: &str, data: &[u8]) -> String {
        let dict = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': (2, 3, 2), }}");
        // Padded with spaces and a newline to a multiple of 64 bytes, as numpy does.
        let total = (10 + dict.len() + 1).div_ceil(64) * 64;
        let header = format!("{dict}{}\n", " ".repeat(total - 10 - dict.len() - 1));
        let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
        bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend_from_slice(data);
        base64::engine::general_purpose::STANDARD.encode(bytes)
    }

    #[test]
    fn uint8_and_uint16_arrays_decode_with_their_shape_and_bad_ones_are_named() {
        let ids: Vec<u8> = (0..12).collect();
        let routed = RoutedExperts::from_base64_npy(&npy("|u1", &ids)).expect("uint8");
        assert_eq!(routed.shape, [2, 3, 2]);
        assert_eq!((routed.width, routed.data), (1, ids.clone()));
        let wide: Vec<u8> = (0..12u16).flat_map(|v| (v * 100).to_le_bytes()).collect();
        let routed = RoutedExperts::from_base64_npy(&npy("<u2", &wide)).expect("uint16");
        assert_eq!((routed.width, routed.data.len()), (2, 24));
        assert_eq!(&routed.data[2..4], &100u16.to_le_bytes());

        let short = RoutedExperts::from_base64_npy(&npy("|u1", &ids[..11])).expect_err("short");
        assert_eq!(short, "11 bytes of ids for shape [2, 3, 2], which needs 12");
        let float = RoutedExperts::from_base64_npy(&npy("<f4", &ids)).expect_err("floats");
        assert!(float.contains("dtype Some(\"<f4\")"), "{float}");
        let text = RoutedExperts::from_base64_npy("not base64!").expect_err("text");
        assert!(text.starts_with("not base64"), "{text}");
    }
}
