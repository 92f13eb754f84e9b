//! The `Module` abstraction: anything with named parameters.

use autograd::Var;

/// A parameter with its hierarchical name.
#[derive(Clone, Debug)]
pub struct NamedParameter {
    pub name: String,
    pub var: Var,
}

/// A layer or model: visits its parameters with dotted, hierarchical names.
pub trait Module {
    /// Calls `visit(name, parameter)` for every parameter, names prefixed with `prefix`
    /// (empty at the top, `"layers.3."` inside a container, ...).
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var));

    /// Every parameter with its full name, in a stable order.
    fn named_parameters(&self) -> Vec<NamedParameter> {
        let mut out = Vec::new();
        self.visit_parameters("", &mut |name, var| out.push(NamedParameter { name, var: var.clone() }));
        out
    }

    /// Total number of scalar parameters.
    fn num_parameters(&self) -> usize {
        let mut total = 0;
        self.visit_parameters("", &mut |_, var| total += var.value_ref().numel());
        total
    }
}

/// Joins a prefix and a local name: `join("layers.0.", "weight")` = `"layers.0.weight"`.
pub fn join(prefix: &str, name: &str) -> String {
    format!("{prefix}{name}")
}
