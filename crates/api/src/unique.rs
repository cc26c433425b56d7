//! A JSON object read into a sorted map, refusing duplicate keys: serde's own maps keep the
//! last of two equal keys without a word, and a document that says one thing twice is
//! ambiguous wherever it is read (a policy's orgs, a quota tree, a request's annotations).

use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, Visitor};
use serde::Deserialize;

use crate::untrusted;

/// A JSON object whose keys are each given once, sorted.
#[derive(Debug, Clone, PartialEq)]
pub struct UniqueMap<V>(pub BTreeMap<String, V>);

impl<V> Default for UniqueMap<V> {
    fn default() -> Self {
        UniqueMap(BTreeMap::new())
    }
}

impl<'de, V: Deserialize<'de>> Deserialize<'de> for UniqueMap<V> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(UniqueMapVisitor(PhantomData))
    }
}

struct UniqueMapVisitor<V>(PhantomData<V>);

impl<'de, V: Deserialize<'de>> Visitor<'de> for UniqueMapVisitor<V> {
    type Value = UniqueMap<V>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<Self::Value, A::Error> {
        let mut out = BTreeMap::new();
        while let Some(key) = access.next_key::<String>()? {
            if out.contains_key(&key) {
                // Fail while reading the value, so a path-tracking reader's path ends in
                // the key.
                let message =
                    format!("duplicate key `{}`: each name may appear once", untrusted(&key));
                access.next_value_seed(Reject(message))?;
                continue;
            }
            let value = access.next_value()?;
            out.insert(key, value);
        }
        Ok(UniqueMap(out))
    }
}

/// A seed that fails with its message instead of reading a value.
struct Reject(String);

impl<'de> DeserializeSeed<'de> for Reject {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, _deserializer: D) -> Result<(), D::Error> {
        Err(de::Error::custom(self.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_given_twice_is_refused_naming_it_escaped() {
        let ok: UniqueMap<u32> = serde_json::from_str(r#"{"b": 2, "a": 1}"#).expect("unique");
        assert_eq!(ok.0.keys().collect::<Vec<_>>(), ["a", "b"]);
        let e = serde_json::from_str::<UniqueMap<u32>>(r#"{"a": 1, "a": 2}"#).unwrap_err();
        assert!(e.to_string().contains("duplicate key `a`: each name may appear once"), "{e}");
        let e = serde_json::from_str::<UniqueMap<u32>>("{\"\\u001b[2J\": 1, \"\\u001b[2J\": 2}")
            .unwrap_err()
            .to_string();
        assert!(!e.contains('\u{1b}'), "escaped: {e}");
        let mut de = serde_json::Deserializer::from_str(r#"{"x": {"a": 1, "a": 2}}"#);
        let e = serde_path_to_error::deserialize::<_, BTreeMap<String, UniqueMap<u32>>>(&mut de)
            .unwrap_err();
        assert_eq!(e.path().to_string(), "x.a", "the path ends in the key");
    }
}
