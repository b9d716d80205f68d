// Notice a lost lease and stop writing. The lease has a short TTL and nobody
// renews it; a pause longer than the TTL (a GC pause, a stalled VM) lets it
// expire. The proxy then refuses the next write under it with 409 lease_lost
// instead of forwarding it, and the worker must stop: another worker may hold
// the lock now.
// Run: java LeaseLost.java   (JDK 17+, no dependencies)
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpRequest.BodyPublishers;
import java.net.http.HttpResponse.BodyHandlers;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

public class LeaseLost {
    static final String API = System.getenv().getOrDefault("FENCER_API", "http://127.0.0.1:7411");
    static final String PROXY = System.getenv().getOrDefault("FENCER_PROXY", "http://127.0.0.1:7412");
    static final String KEY = "example:lost";
    static final HttpClient HTTP = HttpClient.newBuilder().version(HttpClient.Version.HTTP_1_1).build();

    /** An error answer of fencer: {"error": code, "message": text}. */
    static class FencerException extends RuntimeException {
        final String code;

        FencerException(int status, String body) {
            super(status + " " + field(body, "error") + ": " + field(body, "message"));
            code = field(body, "error");
        }
    }

    static String call(String method, String url, String json, String... headers) throws Exception {
        var req = HttpRequest.newBuilder(URI.create(url))
                .header("Content-Type", "application/json")
                .method(method, json == null ? BodyPublishers.noBody() : BodyPublishers.ofString(json));
        if (headers.length > 0) req.headers(headers);
        var res = HTTP.send(req.build(), BodyHandlers.ofString());
        if (res.statusCode() != 200) throw new FencerException(res.statusCode(), res.body());
        return res.body();
    }

    /** The first string or number field so named; use your JSON library in real code. */
    static String field(String json, String name) {
        Matcher m = Pattern.compile("\"" + name + "\"\\s*:\\s*(?:\"([^\"]*)\"|([^,}\\s]+))").matcher(json);
        return !m.find() ? null : m.group(1) != null ? m.group(1) : m.group(2);
    }

    public static void main(String[] args) throws Exception {
        try {
            String lease = call("POST", API + "/v1/locks/" + KEY + "/acquire", "{\"ttl_ms\": 1000, \"wait_ms\": 5000}");
            String leaseId = field(lease, "lease_id");
            System.out.println("acquired token=" + field(lease, "token") + " ttl_ms=" + field(lease, "ttl_ms"));
            for (int balance = 1; balance <= 3; balance++) {
                try {
                    call("PUT", PROXY + "/kv/example/lost", "{\"balance\": " + balance + "}", "Fencing-Lease", leaseId);
                } catch (FencerException e) {
                    if (!"lease_lost".equals(e.code)) throw e;
                    System.out.println("lease lost: stopping");
                    return;
                }
                System.out.println("write ok balance=" + balance);
                System.out.println("pausing 1500 ms (longer than the ttl, no renew)");
                Thread.sleep(1500);
            }
            throw new IllegalStateException("the lease should have been lost");
        } catch (FencerException e) {
            System.err.println("error: " + e.getMessage());
            System.exit(1);
        } catch (java.io.IOException e) {
            System.err.println("error: cannot reach fencer: " + e);
            System.exit(1);
        }
    }
}
