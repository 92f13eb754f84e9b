//! The `Module` abstraction: anything with named parameters, and moving them between
//! devices.

use autograd::{Result, Var};
use tensor::Device;

/// A parameter with its hierarchical name.
#[derive(Clone, Debug)]
pub struct NamedParameter {
    /// The dotted name (`blocks.0.attn.wq.weight`).
    pub name: String,
    /// The parameter itself.
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

    /// The device of the first parameter (the CPU for a module without parameters): where
    /// inputs must be for [`Module::to_device`]d models.
    fn device(&self) -> Device {
        let mut device = None;
        self.visit_parameters("", &mut |_, var| {
            device.get_or_insert_with(|| var.value_ref().device());
        });
        device.unwrap_or(Device::Cpu)
    }

    /// Moves every parameter (and every buffer the visit includes, such as BatchNorm's
    /// running statistics through `vision::StateDict`) to `device`: each value is replaced
    /// by its copy there, and the gradient of a moved parameter is cleared (it lived on the
    /// old device). Parameters already on `device` are left as they are. Optimizers built
    /// over these parameters follow them (their state moves at the next step).
    fn to_device(&self, device: Device) -> Result<()> {
        let mut result = Ok(());
        self.visit_parameters("", &mut |_, var| {
            if result.is_err() || var.value_ref().device() == device {
                return;
            }
            let moved = var.value_ref().to_device(device);
            result = moved.and_then(|value| var.set_value(value));
            var.zero_grad();
        });
        result
    }
}

/// Joins a prefix and a local name: `join("layers.0.", "weight")` = `"layers.0.weight"`.
pub fn join(prefix: &str, name: &str) -> String {
    format!("{prefix}{name}")
}
