//! The graph node (`Var`), the backward walk, and the `no_grad` scope: the tape. Op timing
//! lives in `profile.rs`; the walk only reports to it.

use std::cell::{Cell, Ref, RefCell, RefMut};
use std::collections::{HashMap, HashSet};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use tensor::{Error, Result, Tensor};

use crate::profile::{op_name, profile_backward, profile_forward, profiling};

/// Maps the gradient of an op's output to one gradient per input, in input order. The second
/// argument is the gradient of the first input summed so far, for the ops made by
/// [`Var::from_op_absorbing`] (always `None` for the others).
type BackwardFn = Box<dyn Fn(&Tensor, Option<Tensor>) -> Result<Vec<Tensor>>>;

/// Ids grow with creation, so sorting by id descending is a valid reverse topological
/// order: every input is created before the op that reads it.
static NEXT_ID: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
}

/// A tensor in the autograd graph. Cloning is cheap and shares the node.
///
/// The graph keeps every node that needs a gradient until the backward pass, but not every
/// value: when the last `Var` of an op's output is dropped, its value is released (no one
/// can read it any more), and the backward reads only the tensors each op saved in its
/// closure. So a training step holds what its backward needs, as PyTorch's autograd does,
/// and not every intermediate result of the forward (llama-60m: the packed q, k, v
/// products, the projections' outputs, the FFN's down products).
#[derive(Clone)]
pub struct Var(Rc<Holders>);

/// What every clone of one [`Var`] shares; dropping the last releases an op node's value.
struct Holders(Rc<Node>);

impl Drop for Holders {
    fn drop(&mut self) {
        // Leaves (parameters, data) keep theirs: the model and the optimizer read them.
        if self.0.backward.is_some() {
            *self.0.value.borrow_mut() = None;
        }
    }
}

struct Node {
    id: u64,
    /// `None` once no `Var` holds the node (op nodes only).
    value: RefCell<Option<Tensor>>,
    /// The value's shape, which the backward checks each gradient against.
    shape: Vec<usize>,
    grad: RefCell<Option<Tensor>>,
    requires_grad: bool,
    inputs: Vec<Rc<Node>>,
    backward: Option<BackwardFn>,
    /// Whether `backward` takes over the gradient of `inputs[0]` summed so far.
    absorbs_first_input_gradient: bool,
    /// The op that made this node (`leaf` for parameters and constants), for profiles.
    op: &'static str,
}

/// Why a `Var`'s node still has its value: it is released only when the last `Var` drops.
const HELD: &str = "a Var's value is released only after its last Var is dropped";

impl std::fmt::Debug for Var {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Var")
            .field("id", &self.node().id)
            .field("shape", &self.node().shape)
            .field("requires_grad", &self.node().requires_grad)
            .finish()
    }
}

/// Runs `f` with graph building switched off (evaluation, optimizer steps); restores the
/// previous setting afterwards, even on panic.
pub fn no_grad<T>(f: impl FnOnce() -> T) -> T {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            GRAD_ENABLED.with(|g| g.set(self.0));
        }
    }
    let _restore = Restore(GRAD_ENABLED.with(|g| g.replace(false)));
    f()
}

/// False inside [`no_grad`].
pub fn is_grad_enabled() -> bool {
    GRAD_ENABLED.with(|g| g.get())
}

impl Var {
    /// The node every clone of this `Var` shares.
    fn node(&self) -> &Rc<Node> {
        &self.0 .0
    }

    fn leaf(value: Tensor, requires_grad: bool) -> Var {
        Var(Rc::new(Holders(Rc::new(Node {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            shape: value.shape().to_vec(),
            value: RefCell::new(Some(value)),
            grad: RefCell::new(None),
            requires_grad,
            inputs: Vec::new(),
            backward: None,
            absorbs_first_input_gradient: false,
            op: "leaf",
        }))))
    }

    /// A trainable leaf: gradients accumulate into [`Var::grad`].
    pub fn parameter(value: Tensor) -> Var {
        Var::leaf(value, true)
    }

    /// A leaf that never receives a gradient (data, masks).
    pub fn constant(value: Tensor) -> Var {
        Var::leaf(value, false)
    }

    /// The output of an op over `inputs`. `backward` maps the output's gradient to one
    /// gradient per input (same order, same shapes). When no input needs a gradient, or
    /// inside [`no_grad`], the closure is dropped and the result is a constant.
    pub fn from_op<F>(value: Tensor, inputs: Vec<Var>, backward: F) -> Var
    where
        F: Fn(&Tensor) -> Result<Vec<Tensor>> + 'static,
    {
        Var::op_node(value, inputs, op_name::<F>(), false, Box::new(move |dy, _| backward(dy)))
    }

    /// [`Var::from_op`] whose `backward` also receives the gradient of `inputs[0]` summed so
    /// far (from the ops that read it and ran their backward first: in a pre-ln LLaMA block
    /// the later residual add for RMSNorm, the v projection for the k projection's matmul;
    /// `None` when there is none) and returns `inputs[0]`'s total, so its kernel adds the two
    /// in the pass that writes its own gradient instead of the engine adding them after. The
    /// tensor handed over is the engine's own: `backward` may write the total into its buffer
    /// when it is the buffer's only owner (`Tensor::add_matmul`).
    pub fn from_op_absorbing<F>(value: Tensor, inputs: Vec<Var>, backward: F) -> Var
    where
        F: Fn(&Tensor, Option<Tensor>) -> Result<Vec<Tensor>> + 'static,
    {
        Var::op_node(value, inputs, op_name::<F>(), true, Box::new(backward))
    }

    fn op_node(value: Tensor, inputs: Vec<Var>, op: &'static str, absorbs: bool, backward: BackwardFn) -> Var {
        profile_forward(op);
        if !is_grad_enabled() || !inputs.iter().any(Var::requires_grad) {
            return Var::constant(value);
        }
        Var(Rc::new(Holders(Rc::new(Node {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            shape: value.shape().to_vec(),
            value: RefCell::new(Some(value)),
            grad: RefCell::new(None),
            requires_grad: true,
            inputs: inputs.iter().map(|input| Rc::clone(input.node())).collect(),
            backward: Some(backward),
            absorbs_first_input_gradient: absorbs,
            op,
        }))))
    }

    /// Unique id of this node (parameters are looked up by it).
    pub fn id(&self) -> u64 {
        self.node().id
    }

    /// The value (a cheap clone of the tensor view).
    pub fn value(&self) -> Tensor {
        self.value_ref().clone()
    }

    /// Borrows the value without cloning.
    pub fn value_ref(&self) -> Ref<'_, Tensor> {
        Ref::map(self.node().value.borrow(), |value| value.as_ref().expect(HELD))
    }

    /// Replaces the value of a leaf (optimizer updates, checkpoint loads). The shape must
    /// not change.
    pub fn set_value(&self, value: Tensor) -> Result<()> {
        let current = &self.node().shape;
        if current != value.shape() {
            return Err(Error::ShapeMismatch { op: "set_value", lhs: current.clone(), rhs: value.shape().to_vec() });
        }
        *self.node().value.borrow_mut() = Some(value);
        Ok(())
    }

    /// Mutable access to a leaf's value, for in-place optimizer updates.
    pub fn value_mut(&self) -> RefMut<'_, Tensor> {
        RefMut::map(self.node().value.borrow_mut(), |value| value.as_mut().expect(HELD))
    }

    /// Shape of the value.
    pub fn shape(&self) -> Vec<usize> {
        self.node().shape.clone()
    }

    /// True when gradients flow to or through this node.
    pub fn requires_grad(&self) -> bool {
        self.node().requires_grad
    }

    /// The accumulated gradient of a leaf, if any backward pass reached it.
    pub fn grad(&self) -> Option<Tensor> {
        self.node().grad.borrow().clone()
    }

    /// Replaces the accumulated gradient (gradient clipping, optimizer-side scaling).
    pub fn set_grad(&self, grad: Option<Tensor>) {
        *self.node().grad.borrow_mut() = grad;
    }

    /// Clears the accumulated gradient.
    pub fn zero_grad(&self) {
        self.set_grad(None);
    }

    /// The same value cut off from the graph.
    pub fn detach(&self) -> Var {
        Var::constant(self.value())
    }

    /// Back-propagates from this scalar: `d self / d leaf` accumulates into every leaf
    /// that requires a gradient.
    pub fn backward(&self) -> Result<()> {
        let value = self.value();
        if value.numel() != 1 {
            return Err(Error::InvalidShape {
                op: "backward",
                shape: value.shape().to_vec(),
                reason: "backward() starts from a scalar; use backward_with for other shapes".into(),
            });
        }
        // The seed d self/d self = 1 lives where the value does (a GPU graph stays there).
        self.backward_with(value.full_like(1.0)?)
    }

    /// Back-propagates `seed` (the gradient of some scalar with respect to this node).
    pub fn backward_with(&self, seed: Tensor) -> Result<()> {
        if seed.shape() != self.shape() {
            return Err(Error::ShapeMismatch { op: "backward_with", lhs: self.shape(), rhs: seed.shape().to_vec() });
        }
        let mut grads: HashMap<u64, Tensor> = HashMap::new();
        grads.insert(self.id(), seed);
        let mut clock = profiling().then(Instant::now);
        for node in reachable_in_reverse_order(self.node()) {
            let Some(grad) = grads.remove(&node.id) else { continue };
            let Some(backward) = &node.backward else {
                let mut slot = node.grad.borrow_mut();
                *slot = Some(match slot.take() {
                    Some(previous) => previous.accumulate(grad)?,
                    None => grad,
                });
                clock = profile_backward("leaf gradient", clock);
                continue;
            };
            let pending = match node.inputs.first() {
                Some(first) if node.absorbs_first_input_gradient => grads.remove(&first.id),
                _ => None,
            };
            let input_grads = backward(&grad, pending)?;
            drop(grad);
            for (input, input_grad) in node.inputs.iter().zip(input_grads) {
                if !input.requires_grad {
                    continue;
                }
                if input_grad.shape() != input.shape {
                    return Err(Error::ShapeMismatch {
                        op: "backward (gradient of an op input)",
                        lhs: input.shape.clone(),
                        rhs: input_grad.shape().to_vec(),
                    });
                }
                // d/dx of a value used twice is the sum: added in place when possible.
                let total = match grads.remove(&input.id) {
                    Some(previous) => previous.accumulate(input_grad)?,
                    None => input_grad,
                };
                grads.insert(input.id, total);
            }
            clock = profile_backward(node.op, clock);
        }
        Ok(())
    }
}

/// Every node that needs a gradient and is reachable from `start`, newest first.
fn reachable_in_reverse_order(start: &Rc<Node>) -> Vec<Rc<Node>> {
    let mut seen = HashSet::new();
    let mut stack = vec![Rc::clone(start)];
    let mut order = Vec::new();
    while let Some(node) = stack.pop() {
        if !node.requires_grad || !seen.insert(node.id) {
            continue;
        }
        stack.extend(node.inputs.iter().cloned());
        order.push(node);
    }
    order.sort_by_key(|node| std::cmp::Reverse(node.id));
    order
}
