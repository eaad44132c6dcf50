import numpy as np, flame_core as flame
from flame_models.text_encoders import *
m = load_t5('tests/fixtures/text_encoders/t5', stream=True)
print([n for n,p in m.named_parameters() if p.requires_grad])
ids = np.array([[1,2,3]])
o = m(ids)
print(o.last_hidden_state.requires_grad)
m2 = load_t5('tests/fixtures/text_encoders/t5')
print(m2(ids).last_hidden_state.requires_grad, [n for n,p in m2.named_parameters() if p.requires_grad])
