import sys,tempfile,operator,torch,torch.distributed as d
from torch.utils.checkpoint import CheckpointPolicy as CP
L=int(sys.argv[1]);I=len(sys.argv)>2
d.init_process_group("gloo",init_method="file://"+tempfile.mktemp(),rank=0,world_size=1)
import shardc;G=torch.ops.shardc.gather_param.default
B=next(m for k,m in list(sys.modules.items()) if k.startswith("shardc") and hasattr(m,"ShardcPartitioner"))
from shardc.models.llama import LlamaConfig as C,Transformer as T,TransformerBlock as TB,llama_loss as ll
from torch._functorch.partitioners import min_cut_rematerialization_partition as mc
c=C(n_layers=L,dim=64,n_heads=4,vocab_size=256,max_seq_len=32);sk=TB(c).to("meta")
W={tuple(p.shape) for p in sk.parameters()};o=B.ShardcPartitioner.__call__;S={}
def rw(gm):
 n=0
 for x in list(gm.graph.nodes):
  if x.target is torch.ops.higher_order.invoke_subgraph:
   b=getattr(gm,x.args[0].target);ph=b.graph.find_nodes(op="placeholder");r=b.graph.find_nodes(op="output")[0].args[0]
   for u in list(x.users):
    v=r[u.args[1]]
    if isinstance(v,torch.fx.Node) and v.op=="placeholder":u.replace_all_uses_with(x.args[2+ph.index(v)]);n+=1
 gm.graph.eliminate_dead_code();gm.recompile();return n
def P(s,gm,ji,**k):
 if any(x.target is G for x in gm.graph.nodes):S["rewired"]=rw(gm);return o(s,gm,ji,**k)
 pure={x for x in gm.graph.find_nodes(op="placeholder") if x.name.startswith("primals") and tuple(x.meta["val"].shape) in W}
 for x in gm.graph.nodes:
  if x.op=="call_function" and x.meta.get("partitioner_tag")!="is_backward" and x.all_input_nodes and all(i in pure for i in x.all_input_nodes):pure.add(x);x.meta["recompute"]=CP.MUST_RECOMPUTE;x.meta["ac_graph_id"]=9
 S["body"]=S.get("body",0)+1;return mc(gm,ji,**k)
B.ShardcPartitioner.__call__=P
torch.manual_seed(0);m=T(c);ref=T(c);ref.load_state_dict(m.state_dict());shardc.shard(m);nm=[n for n,_ in sk.named_parameters()]
@torch.compiler.nested_compile_region
def body(p,x,cs,sn):return torch.func.functional_call(sk,p,(x,cs,sn))
def fwd(s,x,cs,sn):return body({n:getattr(s.get_submodule(n.rpartition(".")[0]),n.rpartition(".")[2]) for n in nm},x,cs,sn)
for l in m.layers:l.__class__=type("O",(type(l),),{"forward":fwd})
cm=torch.compile(m,backend=shardc.backend(inductor=I));x=torch.randint(0,256,(2,16))
ll(cm(x),x).backward();ll(ref(x),x).backward()
g=max((p.grad.full_tensor()-q.grad).abs().max().item() for p,q in zip(m.parameters(),ref.parameters()))
print(torch.__version__,"L",L,"ind",I,"maxgrad",g,S)
