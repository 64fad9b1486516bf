import sys,time,json,tempfile,collections,torch,torch.distributed as d
L=int(sys.argv[1]);M=sys.argv[2];I=len(sys.argv)>3
torch.set_num_threads(1)
d.init_process_group("gloo",init_method="file://"+tempfile.mktemp(),rank=0,world_size=1)
import shardc;B=sys.modules["shardc.backend"]
from shardc.models.llama import LlamaConfig as C,Transformer as T,TransformerBlock as TB,llama_loss as ll
N=collections.Counter();o=B.ShardcPartitioner.__call__
def w(s,*a,**k):N["part"]+=1;return o(s,*a,**k)
B.ShardcPartitioner.__call__=w
c=C(n_layers=L,dim=64,n_heads=4,vocab_size=256,max_seq_len=32);torch.manual_seed(0);m=T(c);shardc.shard(m)
if M=="out":
 sk=TB(c).to("meta");nm=[n for n,_ in sk.named_parameters()]
 @torch.compiler.nested_compile_region
 def body(p,x,cs,sn):return torch.func.functional_call(sk,p,(x,cs,sn))
 def fwd(s,x,cs,sn):return body({n:getattr(s.get_submodule(n.rpartition(".")[0]),n.rpartition(".")[2]) for n in nm},x,cs,sn)
 for l in m.layers:l.__class__=type("O",(type(l),),{"forward":fwd})
G={}
def be(g,ex):
 G["g"]=g;t=time.perf_counter();r=B.shardc_backend(g,ex,{"inductor":I});N["backend_s"]=round(time.perf_counter()-t,3);return r
cm=torch.compile(m,backend=be);x=torch.randint(0,256,(2,16));t=time.perf_counter();ll(cm(x),x).backward()
from torch._dynamo.utils import compile_times as ct
a,b=ct(repr="csv",aggregate=True)
print(json.dumps({"L":L,"M":M,"I":I,"torch":torch.__version__,"step_s":round(time.perf_counter()-t,3),"n":dict(N),"subgraphs":[n for n,_ in G["g"].named_children()],"ct":{k:float(v) for k,v in zip(a,b)}}))
