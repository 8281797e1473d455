//! The planner driving a whole serving loop with a fake forward: every
//! sequence's next token is a function of its id and position, so a run
//! disturbed by preemption must give the tokens an undisturbed run gives.
//! KV blocks are the runtime's real pool. Milliseconds, no model.

use std::collections::VecDeque;
use std::time::Instant;

use runtime::{KvPool, Reservation};

use super::*;

/// The fake forward's pick for sequence `id` at context length `at`.
fn token(id: usize, at: usize) -> u32 {
    ((id * 7919 + at * 31) % 1000) as u32
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Length,
    Cancelled,
}

struct Seq {
    id: usize,
    prompt: usize,
    max_tokens: usize,
    blocks: usize,
    generated: Vec<u32>,
    /// KV positions computed (while catching up).
    computed: usize,
    reservation: Option<Reservation>,
    cancelled: bool,
    /// The step that gave its first token.
    first_token: Option<usize>,
}

impl Seq {
    /// What a (re)computed KV must hold: the prompt, and every generated
    /// token but the newest, which is the next decode input.
    fn target(&self) -> usize {
        self.prompt + self.generated.len().saturating_sub(1)
    }

    /// Picks the next token; whether the sequence ended by length.
    fn pick(&mut self, step: usize) -> bool {
        let at = self.prompt + self.generated.len();
        self.generated.push(token(self.id, at));
        self.first_token.get_or_insert(step);
        self.generated.len() >= self.max_tokens
    }
}

struct Sim {
    budget: PrefillBudget,
    max_batch: usize,
    pool: KvPool,
    waiting: VecDeque<Seq>,
    catching_up: Vec<Seq>,
    running: Vec<Seq>,
    preempted: VecDeque<Seq>,
    ended: Vec<(Seq, End)>,
    next_id: usize,
    row_cap: Option<RowCap>,
    oom_streak: u32,
    step: usize,
    /// Per step: rows decoded and prompt tokens computed.
    work: Vec<(usize, usize)>,
}

impl Sim {
    fn new(chunk: usize, max_batch: usize, blocks: usize) -> Self {
        Self {
            budget: PrefillBudget::from(chunk),
            max_batch,
            pool: KvPool::new(blocks, 16, 1),
            waiting: VecDeque::new(),
            catching_up: Vec::new(),
            running: Vec::new(),
            preempted: VecDeque::new(),
            ended: Vec::new(),
            next_id: 0,
            row_cap: None,
            oom_streak: 0,
            step: 0,
            work: Vec::new(),
        }
    }

    fn submit(&mut self, prompt: usize, max_tokens: usize) -> usize {
        let id = self.next_id;
        self.next_id += 1;
        self.waiting.push_back(Seq {
            id,
            prompt,
            max_tokens,
            blocks: self.pool.blocks_for(prompt + max_tokens),
            generated: Vec::new(),
            computed: 0,
            reservation: None,
            cancelled: false,
            first_token: None,
        });
        id
    }

    /// The step that gave sequence `id` its first token.
    fn first_token(&self, id: usize) -> Option<usize> {
        let mut all = (self.waiting.iter())
            .chain(&self.catching_up)
            .chain(&self.running)
            .chain(&self.preempted)
            .chain(self.ended.iter().map(|(s, _)| s));
        all.find(|s| s.id == id).and_then(|s| s.first_token)
    }

    fn cancel(&mut self, id: usize) {
        let all = self
            .waiting
            .iter_mut()
            .chain(&mut self.catching_up)
            .chain(&mut self.running)
            .chain(&mut self.preempted);
        for s in all.filter(|s| s.id == id) {
            s.cancelled = true;
        }
    }

    fn end(&mut self, mut s: Seq, why: End) {
        s.reservation = None;
        if let Some(cap) = self.row_cap.take() {
            self.row_cap = cap.rows_finished(1, self.max_batch, Instant::now());
        }
        self.ended.push((s, why));
    }

    fn drop_cancelled(&mut self) {
        let mut gone = Vec::new();
        for list in [&mut self.catching_up, &mut self.running] {
            let (out, keep): (Vec<Seq>, Vec<Seq>) = list.drain(..).partition(|s| s.cancelled);
            *list = keep;
            gone.extend(out);
        }
        for queue in [&mut self.waiting, &mut self.preempted] {
            let (out, keep): (Vec<Seq>, Vec<Seq>) = queue.drain(..).partition(|s| s.cancelled);
            *queue = keep.into();
            gone.extend(out);
        }
        for s in gone {
            self.end(s, End::Cancelled);
        }
    }

    fn reserve_front(&mut self) -> Option<Seq> {
        let blocks = self.waiting.front()?.blocks;
        let reservation = self.pool.try_reserve(blocks).ok()?;
        let mut s = self.waiting.pop_front()?;
        s.reservation = Some(reservation);
        Some(s)
    }

    /// One iteration of the loop: plan, admit, the prompt work, a decode
    /// step. Returns the plan.
    fn step(&mut self) -> StepPlan {
        self.drop_cancelled();
        let catching_up: Vec<CatchUp> = self
            .catching_up
            .iter()
            .map(|s| CatchUp {
                computed: s.computed,
                target: s.target(),
            })
            .collect();
        let preempted: Vec<usize> = self.preempted.iter().map(Seq::target).collect();
        let waiting = self.waiting.iter().map(|s| Candidate {
            prompt_len: s.prompt,
            blocks: s.blocks,
            images: false,
            prefix_hit: false,
        });
        let row_limit = self
            .row_cap
            .map_or(self.max_batch, |c| c.limit().min(self.max_batch));
        let plan = plan(
            State {
                decoding: self.running.len(),
                catching_up: &catching_up,
                preempted: &preempted,
                waiting,
                free_blocks: self.pool.total() - self.pool.allocated(),
                row_limit,
            },
            self.budget,
        );
        let mut chunks = plan.chunks.clone();
        let mut prompt_work = 0;
        match plan.admit {
            None => {}
            Some(Admit::Rejoin { tokens }) => {
                let s = self.preempted.pop_front().unwrap();
                self.catching_up.push(s);
                chunks.push(tokens);
            }
            Some(Admit::Chunked { tokens }) => {
                if let Some(s) = self.reserve_front() {
                    self.catching_up.push(s);
                    chunks.push(tokens);
                }
            }
            Some(Admit::Group(n)) => {
                for _ in 0..n {
                    let Some(mut s) = self.reserve_front() else {
                        break;
                    };
                    prompt_work += s.prompt;
                    match s.pick(self.step) {
                        true => self.end(s, End::Length),
                        false => self.running.push(s),
                    }
                }
            }
        }
        let mut i = 0;
        for tokens in chunks {
            let s = &mut self.catching_up[i];
            let take = tokens.min(s.target() - s.computed);
            s.computed += take;
            prompt_work += take;
            if tokens == 0 || s.computed < s.target() {
                i += 1;
                continue;
            }
            let mut s = self.catching_up.remove(i);
            // A recomputed row's next input is its newest token: no pick.
            if !s.generated.is_empty() {
                self.running.push(s);
            } else if s.pick(self.step) {
                self.end(s, End::Length);
            } else {
                self.running.push(s);
            }
        }
        let decoded = self.running.len();
        let mut kept = Vec::new();
        for mut s in std::mem::take(&mut self.running) {
            match s.pick(self.step) {
                true => self.end(s, End::Length),
                false => kept.push(s),
            }
        }
        self.running = kept;
        self.work.push((decoded, prompt_work));
        self.step += 1;
        plan
    }

    /// The step ran out of memory: every started row gives up its KV and
    /// waits to be recomputed, oldest first.
    fn out_of_memory(&mut self) {
        self.oom_streak += 1;
        let mut rows: Vec<Seq> = self.running.drain(..).collect();
        rows.extend(self.catching_up.drain(..));
        rows.extend(self.preempted.drain(..));
        rows.sort_by_key(|s| s.id);
        let (shed, cap) = after_oom(
            rows.len(),
            self.oom_streak,
            self.row_cap.take(),
            Instant::now(),
        );
        assert_eq!(shed, 0, "within the retries");
        self.row_cap = Some(cap);
        for mut s in rows {
            s.computed = 0;
            self.preempted.push_back(s);
        }
    }

    fn idle(&self) -> bool {
        self.waiting.is_empty()
            && self.catching_up.is_empty()
            && self.running.is_empty()
            && self.preempted.is_empty()
    }

    fn run_to_end(&mut self) {
        for _ in 0..10_000 {
            if self.idle() {
                return;
            }
            self.step();
        }
        panic!("the loop did not drain");
    }

    fn ended(&self, id: usize) -> &(Seq, End) {
        self.ended.iter().find(|(s, _)| s.id == id).unwrap()
    }

    /// The tokens an undisturbed sequence gives.
    fn expected(&self, id: usize) -> Vec<u32> {
        let (s, _) = self.ended(id);
        (0..s.max_tokens).map(|k| token(id, s.prompt + k)).collect()
    }
}

#[test]
fn requests_wait_for_kv_and_finished_rows_give_their_blocks_back() {
    // Room for two requests of 100 + 28 tokens (8 blocks each).
    let mut sim = Sim::new(256, 32, 16);
    let ids: Vec<usize> = (0..3).map(|_| sim.submit(100, 28)).collect();
    let plan = sim.step();
    assert_eq!(plan.admit, Some(Admit::Group(2)), "the third waits for KV");
    assert_eq!(sim.pool.allocated(), 16);
    assert_eq!(sim.waiting.len(), 1);
    sim.run_to_end();
    for id in ids {
        let (s, end) = sim.ended(id);
        assert_eq!((s.generated.clone(), *end), (sim.expected(id), End::Length));
    }
    assert_eq!(sim.pool.allocated(), 0, "every block back");
    let third = sim.first_token(2).unwrap();
    assert_eq!(third, 27, "started once a row had finished");
}

#[test]
fn a_long_prompt_is_chunked_while_every_running_row_decodes_each_step() {
    let mut sim = Sim::new(256, 32, 1000);
    let short: Vec<usize> = (0..7).map(|_| sim.submit(20, 200)).collect();
    sim.step();
    assert_eq!(sim.running.len(), 7);
    let long = sim.submit(1000, 8);
    let from = sim.step;
    while sim.first_token(long).is_none() {
        sim.step();
    }
    // Five steps of at most 256 - 7 prompt tokens, each beside a decode
    // step of the seven rows.
    let steps = &sim.work[from..];
    assert_eq!(steps.len(), 5, "{steps:?}");
    for &(decoded, prompt) in steps {
        assert!(decoded >= 7 && prompt <= 256 - 7, "{steps:?}");
    }
    sim.run_to_end();
    for id in short.into_iter().chain([long]) {
        assert_eq!(sim.ended(id).0.generated, sim.expected(id));
    }
}

#[test]
fn a_second_long_prompt_starts_with_what_the_first_leaves() {
    let mut sim = Sim::new(256, 32, 1000);
    let first = sim.submit(1000, 4);
    let second = sim.submit(1000, 4);
    sim.run_to_end();
    let (a, b) = (sim.first_token(first), sim.first_token(second));
    // 2000 tokens at 256 a step, less what the first row's decode takes.
    assert_eq!((a, b), (Some(3), Some(7)));
    let (_, prompt) = sim.work[3];
    assert_eq!(
        prompt, 256,
        "the first's last chunk and the second's first share a step"
    );
}

#[test]
fn cancelled_requests_end_wherever_they_are_and_free_their_blocks() {
    let mut sim = Sim::new(64, 32, 1000);
    let running = sim.submit(10, 1000);
    sim.step();
    let prefilling = sim.submit(500, 10);
    sim.step();
    let waiting = sim.submit(500, 10);
    sim.step();
    assert_eq!(
        (sim.running.len(), sim.catching_up.len(), sim.waiting.len()),
        (1, 1, 1)
    );
    for id in [running, prefilling, waiting] {
        sim.cancel(id);
    }
    sim.step();
    assert!(sim.idle());
    for id in [running, prefilling, waiting] {
        assert_eq!(sim.ended(id).1, End::Cancelled);
    }
    assert_eq!(sim.pool.allocated(), 0);
}

#[test]
fn rows_preempted_after_running_out_of_memory_are_recomputed_with_the_same_tokens() {
    let mut sim = Sim::new(32, 32, 1000);
    let ids: Vec<usize> = [8, 20, 100, 50]
        .iter()
        .map(|&n| sim.submit(n, 40))
        .collect();
    for _ in 0..6 {
        sim.step();
    }
    let before = sim.pool.allocated();
    sim.out_of_memory();
    assert_eq!(sim.preempted.len(), 4);
    assert_eq!(sim.pool.allocated(), before, "reservations are kept");
    // Half the rows at once: two recompute before the others rejoin.
    for _ in 0..3 {
        sim.step();
        assert!(sim.running.len() + sim.catching_up.len() <= 2);
    }
    sim.out_of_memory();
    assert_eq!(sim.row_cap.unwrap().limit(), 1, "halved again");
    sim.run_to_end();
    for id in ids {
        let (s, end) = sim.ended(id);
        assert_eq!((s.generated.clone(), *end), (sim.expected(id), End::Length));
    }
    assert_eq!(sim.pool.allocated(), 0);
}
