//! [`field_names`]: the keys a serde struct reads, for settings read from one table by
//! several structs (the binary's file, the bridge's settings, a reward table's kinds).

/// The field names a serde struct reads (renames applied, skipped fields left out): the keys
/// of a settings file or mapping that reads several structs from one table (the binary's
/// file, the bridge's settings), so that a key none of them reads can be refused.
pub fn field_names<T: serde::de::DeserializeOwned>() -> &'static [&'static str] {
    /// Answers the struct's `deserialize_struct` call with its field list, through the error.
    struct Fields;
    #[derive(Debug)]
    struct Found(&'static [&'static str]);
    impl std::fmt::Display for Found {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "{:?}", self.0)
        }
    }
    impl std::error::Error for Found {}
    impl serde::de::Error for Found {
        fn custom<M: std::fmt::Display>(_: M) -> Self {
            Found(&[])
        }
    }
    impl<'de> serde::Deserializer<'de> for Fields {
        type Error = Found;
        fn deserialize_struct<V: serde::de::Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Found> {
            Err(Found(fields))
        }
        fn deserialize_any<V: serde::de::Visitor<'de>>(self, _: V) -> Result<V::Value, Found> {
            Err(Found(&[]))
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
            byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map enum
            identifier ignored_any
        }
    }
    match T::deserialize(Fields) {
        Err(Found(fields)) => fields,
        Ok(_) => &[],
    }
}
