"""Reading traced programs in tests: every equation of a jaxpr, nested jaxprs included."""
import jax.extend


def equations(jaxpr):
  """Every equation of a jaxpr (or closed jaxpr) in program order, each nested jaxpr's
  equations right after the equation that holds it."""
  for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
    yield eqn
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from equations(sub)


def ffi_calls(jaxpr) -> list:
  """(target name, attributes as ints) of every ffi_call in a jaxpr, nested ones included."""
  return [(eqn.params["target_name"],
           {k: int(v) for k, v in dict(eqn.params["attributes"]).items()})
          for eqn in equations(jaxpr) if eqn.primitive.name == "ffi_call"]
