//! The small list a request keeps its runs and held events in.

/// A list that keeps its first two items in place: nearly every request has one run, and
/// a run holds one or two events before its first byte (a run's `START`, a tunnel's
/// head), so neither allocates.
#[derive(Debug)]
pub(in crate::edge) struct Few<T> {
    head: [Option<T>; 2],
    rest: Vec<T>,
}

impl<T> Default for Few<T> {
    fn default() -> Self {
        Few {
            head: [None, None],
            rest: Vec::new(),
        }
    }
}

impl<T> Few<T> {
    pub(in crate::edge) fn push(&mut self, item: T) {
        match &mut self.head {
            [slot @ None, _] | [Some(_), slot @ None] if self.rest.is_empty() => {
                *slot = Some(item);
            }
            _ => self.rest.push(item),
        }
    }

    pub(in crate::edge) fn len(&self) -> usize {
        self.head.iter().flatten().count() + self.rest.len()
    }

    pub(in crate::edge) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(in crate::edge) fn clear(&mut self) {
        self.head = [None, None];
        self.rest.clear();
    }

    pub(in crate::edge) fn iter(&self) -> impl Iterator<Item = &T> {
        self.head.iter().flatten().chain(&self.rest)
    }

    /// Every item, in order, taken out.
    pub(in crate::edge) fn drain(&mut self) -> impl Iterator<Item = T> + use<T> {
        std::mem::take(self).into_iter()
    }

    /// Keeps the items `keep` says, in order.
    pub(in crate::edge) fn retain(&mut self, mut keep: impl FnMut(&T) -> bool) {
        if self.rest.is_empty() {
            for slot in &mut self.head {
                if slot.as_ref().is_some_and(|item| !keep(item)) {
                    *slot = None;
                }
            }
            if self.head[0].is_none() {
                self.head.swap(0, 1);
            }
            return;
        }
        let kept: Vec<T> = std::mem::take(self)
            .into_iter()
            .filter(|item| keep(item))
            .collect();
        for item in kept {
            self.push(item);
        }
    }
}

impl<T> IntoIterator for Few<T> {
    type Item = T;
    type IntoIter = std::iter::Chain<
        std::iter::Flatten<std::array::IntoIter<Option<T>, 2>>,
        std::vec::IntoIter<T>,
    >;

    fn into_iter(self) -> Self::IntoIter {
        self.head.into_iter().flatten().chain(self.rest)
    }
}

#[cfg(test)]
mod tests;
