// Auto-renew with keepalive: the sidecar renews the lease for us as long as
// we show we are alive (a keepalive call, or a proxied request under the
// lease, within keepalive_ms). If this process hangs or dies, renewal stops
// and the lease runs out within keepalive_ms + ttl_ms.
// Run: java AutoRenew.java   (JDK 17+, no dependencies)
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpRequest.BodyPublishers;
import java.net.http.HttpResponse.BodyHandlers;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

public class AutoRenew {
    static final String API = System.getenv().getOrDefault("FENCER_API", "http://127.0.0.1:7411");
    static final String KEY = "example:auto-renew";
    static final HttpClient HTTP = HttpClient.newBuilder().version(HttpClient.Version.HTTP_1_1).build();

    /** An error answer of fencer: {"error": code, "message": text}. */
    static class FencerException extends RuntimeException {
        final String code;

        FencerException(int status, String body) {
            super(status + " " + field(body, "error") + ": " + field(body, "message"));
            code = field(body, "error");
        }
    }

    static String call(String method, String url, String json) throws Exception {
        var req = HttpRequest.newBuilder(URI.create(url))
                .header("Content-Type", "application/json")
                .method(method, json == null ? BodyPublishers.noBody() : BodyPublishers.ofString(json))
                .build();
        var res = HTTP.send(req, BodyHandlers.ofString());
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
            String lease = call("POST", API + "/v1/locks/" + KEY + "/acquire",
                    "{\"ttl_ms\": 1000, \"auto_renew\": true, \"keepalive_ms\": 2000, \"wait_ms\": 5000}");
            String leaseId = "{\"lease_id\": \"" + field(lease, "lease_id") + "\"}";
            System.out.println("acquired token=" + field(lease, "token") + " ttl_ms=" + field(lease, "ttl_ms"));
            try {
                for (int step = 1; step <= 6; step++) {
                    Thread.sleep(500); // one chunk of work
                    // "I am alive"; 409 lease_lost here means: stop working, the lock is gone
                    call("POST", API + "/v1/locks/" + KEY + "/keepalive", leaseId);
                    System.out.println("step " + step + ": keepalive ok");
                }
                String state = field(call("GET", API + "/v1/locks/" + KEY, null), "state");
                System.out.println("after 3000 ms with a 1000 ms ttl: " + state);
            } finally {
                call("POST", API + "/v1/locks/" + KEY + "/release", leaseId);
                System.out.println("released");
            }
        } catch (FencerException e) {
            System.err.println("error: " + e.getMessage());
            System.exit(1);
        } catch (java.io.IOException e) {
            System.err.println("error: cannot reach fencer: " + e);
            System.exit(1);
        }
    }
}
