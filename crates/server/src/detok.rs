//! Incremental detokenization. Decoding tokens one by one breaks characters that span
//! several byte-level tokens and loses the spacing that depends on neighbours, so we use
//! the prefix-offset method (as TGI and vLLM do): decode a short window ending at the new
//! token and emit only the text beyond the window's already-emitted prefix, holding back
//! while the tail is an incomplete UTF-8 sequence (decoded as U+FFFD).

use tokenrouter_api::TextError;

/// Running state of one generated sequence.
#[derive(Debug, Default)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    /// Start of the window used as decoding context.
    prefix_offset: usize,
    /// End of the tokens whose text has been emitted.
    read_offset: usize,
}

impl IncrementalDecoder {
    /// Adds `id` and returns the newly completed text (possibly empty while a character is
    /// still incomplete).
    pub fn push<F>(&mut self, id: u32, decode: F) -> Result<String, TextError>
    where
        F: Fn(&[u32]) -> Result<String, TextError>,
    {
        self.ids.push(id);
        let prefix = decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let full = decode(&self.ids[self.prefix_offset..])?;
        if full.len() > prefix.len()
            && full.is_char_boundary(prefix.len())
            && full.starts_with(&prefix)
            && !full.ends_with(char::REPLACEMENT_CHARACTER)
        {
            let new_text = full[prefix.len()..].to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            Ok(new_text)
        } else {
            Ok(String::new())
        }
    }

    /// Text of tokens still held back (an incomplete character at the end of generation),
    /// decoded lossily; empty when nothing is pending.
    pub fn flush<F>(&mut self, decode: F) -> Result<String, TextError>
    where
        F: Fn(&[u32]) -> Result<String, TextError>,
    {
        if self.read_offset == self.ids.len() {
            return Ok(String::new());
        }
        let prefix = decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let full = decode(&self.ids[self.prefix_offset..])?;
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        if full.len() > prefix.len() && full.is_char_boundary(prefix.len()) {
            Ok(full[prefix.len()..].to_string())
        } else {
            Ok(String::new())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Byte-level vocabulary: id = byte.
    fn bytes_decode(ids: &[u32]) -> Result<String, TextError> {
        let bytes: Vec<u8> = ids.iter().map(|&i| i as u8).collect();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    #[test]
    fn multibyte_characters_are_held_until_complete() {
        let text = "aé日本🙂z";
        let mut dec = IncrementalDecoder::default();
        let mut pieces = Vec::new();
        for b in text.bytes() {
            let piece = dec.push(u32::from(b), bytes_decode).unwrap();
            assert!(!piece.contains(char::REPLACEMENT_CHARACTER));
            pieces.push(piece);
        }
        assert_eq!(pieces.concat(), text);
        // "é" is two bytes: the first push yields nothing, the second the whole char.
        assert_eq!(pieces[1], "");
        assert_eq!(pieces[2], "é");
        assert_eq!(dec.flush(bytes_decode).unwrap(), "");
    }

    #[test]
    fn flush_emits_a_truncated_character_lossily() {
        let mut dec = IncrementalDecoder::default();
        assert_eq!(dec.push(b'a'.into(), bytes_decode).unwrap(), "a");
        assert_eq!(dec.push(0xE6, bytes_decode).unwrap(), "");
        assert_eq!(dec.flush(bytes_decode).unwrap(), "\u{FFFD}");
    }

    #[test]
    fn context_dependent_spacing_is_kept() {
        // A toy tokenizer that strips a leading space of the whole decoded string, like
        // SentencePiece does: decoding token by token would lose every space.
        let vocab = [" Hello", " world", " !"];
        let decode = |ids: &[u32]| -> Result<String, TextError> {
            let s: String = ids.iter().map(|&i| vocab[i as usize]).collect();
            Ok(s.strip_prefix(' ').unwrap_or(&s).to_string())
        };
        let mut dec = IncrementalDecoder::default();
        let out: String = (0..3).map(|i| dec.push(i, decode).unwrap()).collect();
        assert_eq!(out, "Hello world !");
    }
}
