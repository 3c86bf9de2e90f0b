//! A node's children, by the first block hash of each child's edge.
//!
//! Most nodes have one or two children (a turn's continuation, a divergence), a few have many
//! (the root, a system prompt that many conversations continue). Up to [`INLINE`] children live
//! in the node itself, so a match that walks from a node to its child reads no other memory; a
//! node with more keeps them in a hash map.
//!
//! Iteration order is unspecified (the map's for a node with many children).

use hashbrown::HashMap;

use super::tree::NodeId;

/// Children kept in the node before a map is allocated.
const INLINE: usize = 2;

#[derive(Clone, Debug)]
pub(crate) enum Children {
    /// The first `len` keys and ids are the children.
    Inline {
        len: u8,
        keys: [u64; INLINE],
        ids: [NodeId; INLINE],
    },
    Map(Box<HashMap<u64, NodeId>>),
}

impl Default for Children {
    fn default() -> Self {
        Children::Inline { len: 0, keys: [0; INLINE], ids: [0; INLINE] }
    }
}

impl Children {
    /// The child whose edge starts with block `first`.
    #[inline]
    pub fn get(&self, first: &u64) -> Option<&NodeId> {
        match self {
            Children::Inline { len, keys, ids } => {
                let n = usize::from(*len);
                keys[..n].iter().position(|k| k == first).map(|i| &ids[i])
            }
            Children::Map(map) => map.get(first),
        }
    }

    /// Sets the child for `first`; returns the child it replaces, if any.
    pub fn insert(&mut self, first: u64, id: NodeId) -> Option<NodeId> {
        match self {
            Children::Inline { len, keys, ids } => {
                let n = usize::from(*len);
                if let Some(i) = keys[..n].iter().position(|&k| k == first) {
                    return Some(std::mem::replace(&mut ids[i], id));
                }
                if n < INLINE {
                    keys[n] = first;
                    ids[n] = id;
                    *len += 1;
                    return None;
                }
                let mut map: HashMap<u64, NodeId> = keys.iter().copied().zip(*ids).collect();
                map.insert(first, id);
                *self = Children::Map(Box::new(map));
                None
            }
            Children::Map(map) => map.insert(first, id),
        }
    }

    /// Removes the child for `first`; returns it, if there was one.
    pub fn remove(&mut self, first: &u64) -> Option<NodeId> {
        match self {
            Children::Inline { len, keys, ids } => {
                let n = usize::from(*len);
                let i = keys[..n].iter().position(|k| k == first)?;
                let id = ids[i];
                keys.copy_within(i + 1..n, i);
                ids.copy_within(i + 1..n, i);
                *len -= 1;
                Some(id)
            }
            Children::Map(map) => map.remove(first),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Children::Inline { len, .. } => usize::from(*len),
            Children::Map(map) => map.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The children's ids.
    pub fn values(&self) -> impl Iterator<Item = &NodeId> {
        let (inline, map) = match self {
            Children::Inline { len, ids, .. } => (&ids[..usize::from(*len)], None),
            Children::Map(map) => (&[][..], Some(map.values())),
        };
        inline.iter().chain(map.into_iter().flatten())
    }

    /// Heap bytes beyond the node: the map's table, for a node with many children.
    #[cfg(test)]
    pub fn heap_bytes(&self) -> u64 {
        match self {
            Children::Inline { .. } => 0,
            Children::Map(map) => super::engine_map::table_bytes(map),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn behaves_as_a_map_inline_and_past_it() {
        let mut c = Children::default();
        let mut model: HashMap<u64, NodeId> = HashMap::new();
        // Keys chosen to collide in position order; removals from the front, middle and back.
        let ops: [(bool, u64, NodeId); 14] = [
            (true, 5, 1),
            (true, 7, 2),
            (true, 5, 3),
            (false, 5, 0),
            (true, 9, 4),
            (true, 11, 5),
            (true, 13, 6),
            (false, 9, 0),
            (false, 42, 0),
            (false, 7, 0),
            (false, 11, 0),
            (false, 13, 0),
            (true, 1, 7),
            (false, 1, 0),
        ];
        for (insert, key, id) in ops {
            if insert {
                assert_eq!(c.insert(key, id), model.insert(key, id));
            } else {
                assert_eq!(c.remove(&key), model.remove(&key));
            }
            assert_eq!(c.len(), model.len());
            assert_eq!(c.is_empty(), model.is_empty());
            for k in [1, 5, 7, 9, 11, 13, 42] {
                assert_eq!(c.get(&k), model.get(&k));
            }
            let mut got: Vec<NodeId> = c.values().copied().collect();
            let mut want: Vec<NodeId> = model.values().copied().collect();
            got.sort_unstable();
            want.sort_unstable();
            assert_eq!(got, want);
        }
    }

    #[test]
    fn a_few_children_need_no_heap() {
        let mut c = Children::default();
        c.insert(1, 1);
        c.insert(2, 2);
        assert_eq!(c.heap_bytes(), 0);
        c.insert(3, 3);
        assert!(c.heap_bytes() > 0);
    }
}
