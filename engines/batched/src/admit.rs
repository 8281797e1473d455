//! The scheduler's admission decision, apart from the device: how the
//! requests at the front of the wait queue start. Plain data in, a plan
//! out, so the rules (batch slots, KV blocks, grouping under the prefill
//! budget) are tested without a model.

/// What admission looks at in a waiting request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    pub prompt_len: usize,
    /// KV blocks it reserves for prompt + max_tokens.
    pub blocks: usize,
    pub images: bool,
    /// The prefix cache holds a reusable prefix of its prompt.
    pub prefix_hit: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// The front request alone, prefilled chunk by chunk: a long prompt,
    /// images (their chunks replace embeddings), or a prefix-cache hit to
    /// resume from.
    Chunked,
    /// The first `n` requests together, in one left-padded prefill forward.
    Group(usize),
}

/// How much one prefill forward takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillBudget {
    /// A prompt longer than this is prefilled alone, chunk by chunk.
    pub chunk: usize,
    /// Padded tokens (rows times the padded width) of one group.
    pub group_tokens: usize,
    /// A group's width is its longest prompt rounded up to a multiple of
    /// this: on the GPU every new forward shape costs MLX a one-time
    /// 50-100 ms (kernel and attention-graph builds), so widths repeat.
    pub width_multiple: usize,
}

impl PrefillBudget {
    /// The width of a group of `rows` prompts whose longest has `longest`
    /// tokens: rounded up to `width_multiple` while the group stays within
    /// `group_tokens`, else the longest prompt's.
    pub fn width(&self, longest: usize, rows: usize) -> usize {
        let multiple = self.width_multiple.max(1);
        let rounded = longest.div_ceil(multiple) * multiple;
        match rounded * rows <= self.group_tokens {
            true => rounded,
            false => longest,
        }
    }
}

impl From<usize> for PrefillBudget {
    /// Groups within one chunk too, as wide as their longest prompt.
    fn from(chunk: usize) -> Self {
        Self {
            chunk,
            group_tokens: chunk,
            width_multiple: 1,
        }
    }
}

/// How the front of the queue starts, or `None` when it must wait: the
/// queue is empty, no batch slot is free (`room`), or the front request's
/// KV does not fit the free blocks (requests keep their order: a small one
/// behind does not overtake). A group takes followers while there is room,
/// their KV fits too, the padded group stays within the budget's
/// `group_tokens`, and they need no chunked start themselves. `queue` is
/// read lazily, only as far as the decision needs.
pub fn plan(
    queue: impl IntoIterator<Item = Candidate>,
    room: usize,
    free_blocks: usize,
    budget: impl Into<PrefillBudget>,
) -> Option<Start> {
    let budget = budget.into();
    let mut queue = queue.into_iter();
    let first = queue.next()?;
    if room == 0 || first.blocks > free_blocks {
        return None;
    }
    if first.prefix_hit || first.images || first.prompt_len > budget.chunk {
        return Some(Start::Chunked);
    }
    let (mut n, mut longest, mut blocks) = (1, first.prompt_len, first.blocks);
    for next in queue.take(room - 1) {
        let padded = budget.width(longest.max(next.prompt_len), n + 1) * (n + 1);
        if padded > budget.group_tokens
            || next.images
            || next.prefix_hit
            || blocks + next.blocks > free_blocks
        {
            break;
        }
        n += 1;
        longest = longest.max(next.prompt_len);
        blocks += next.blocks;
    }
    Some(Start::Group(n))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A text prompt of `prompt_len` tokens that needs one KV block.
    pub(crate) fn short(prompt_len: usize) -> Candidate {
        Candidate {
            prompt_len,
            blocks: 1,
            images: false,
            prefix_hit: false,
        }
    }

    #[test]
    fn nothing_starts_without_work_a_slot_or_kv() {
        assert_eq!(plan([], 4, 100, 512), None);
        assert_eq!(plan([short(8)], 0, 100, 512), None, "batch full");
        let big = Candidate {
            blocks: 10,
            ..short(8)
        };
        assert_eq!(
            plan([big, short(8)], 4, 9, 512),
            None,
            "KV exhausted: wait, in order"
        );
        assert_eq!(plan([big], 4, 10, 512), Some(Start::Group(1)));
    }

    #[test]
    fn long_prompts_images_and_prefix_hits_start_alone_in_chunks() {
        assert_eq!(
            plan([short(513), short(8)], 4, 100, 512),
            Some(Start::Chunked)
        );
        let image = Candidate {
            images: true,
            ..short(8)
        };
        assert_eq!(plan([image, short(8)], 4, 100, 512), Some(Start::Chunked));
        let hit = Candidate {
            prefix_hit: true,
            ..short(8)
        };
        assert_eq!(plan([hit, short(8)], 4, 100, 512), Some(Start::Chunked));
    }

    #[test]
    fn short_prompts_group_within_the_slots_the_budget_and_the_kv() {
        let five = [short(8); 5];
        assert_eq!(plan(five, 3, 100, 512), Some(Start::Group(3)), "free slots");
        assert_eq!(plan(five, 8, 100, 512), Some(Start::Group(5)), "all");
        assert_eq!(plan(five, 8, 2, 512), Some(Start::Group(2)), "free KV");
        // Padded to the longest: 3 x 100 fits 300, a fourth would not.
        let mixed = [short(10), short(100), short(20), short(30)];
        assert_eq!(plan(mixed, 8, 100, 300), Some(Start::Group(3)));
        // A wider group budget (a hybrid model's) takes all four.
        let wide = PrefillBudget {
            chunk: 300,
            group_tokens: 1200,
            width_multiple: 1,
        };
        assert_eq!(plan(mixed, 8, 100, wide), Some(Start::Group(4)));
        // Widths rounded up to 32 (the GPU's) while the group fits: two
        // rows at 128; three would not fit 300 at 128, so they keep the
        // longest prompt's 100, and a fourth fits neither way.
        let rounded = PrefillBudget {
            width_multiple: 32,
            group_tokens: 300,
            ..wide
        };
        assert_eq!((rounded.width(100, 2), rounded.width(100, 3)), (128, 100));
        assert_eq!(plan(mixed, 8, 100, rounded), Some(Start::Group(3)));
    }

    #[test]
    fn a_group_stops_before_one_that_must_start_alone() {
        let image = Candidate {
            images: true,
            ..short(8)
        };
        let hit = Candidate {
            prefix_hit: true,
            ..short(8)
        };
        assert_eq!(
            plan([short(8), image, short(8)], 8, 100, 512),
            Some(Start::Group(1))
        );
        assert_eq!(
            plan([short(8), short(8), hit], 8, 100, 512),
            Some(Start::Group(2))
        );
    }

    #[test]
    fn the_queue_is_read_only_as_far_as_needed() {
        let mut read = 0;
        let queue = std::iter::repeat_with(|| {
            read += 1;
            short(8)
        });
        assert_eq!(plan(queue, 3, 100, 512), Some(Start::Group(3)));
        assert_eq!(read, 3);
    }
}
